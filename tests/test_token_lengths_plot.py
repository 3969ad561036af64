"""token_lengths.png fits its data: half-octave bins from the shortest length seen to the longest, whatever
tokenize.max_length is (read from the figure object, not from pixels)."""
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from drafter_data.tokens.lengths import LengthHistograms  # noqa: E402


def drawn(hist: LengthHistograms):
    fig, ax = plt.subplots()
    hist.draw(ax, estimated_reasoning=False)
    return fig, ax


def test_the_axis_spans_the_data_not_max_length(tmp_path):
    hist = LengthHistograms(16384)
    hist.add("row", [300, 450, 900])
    hist.add("reasoning", [0, 0, 120, 400])  # zeros: thinking off, not on the log axis
    hist.add("answer", [60, 200])
    fig, ax = drawn(hist)
    lo, hi = ax.get_xlim()
    assert 60 / math.sqrt(2) <= lo <= 60 and 900 <= hi <= 900 * math.sqrt(2), (lo, hi)
    assert ax.get_xscale() == "log"
    for patch in ax.patches:  # every bin drawn is half an octave wide and inside the axis
        edges = patch.get_data().edges
        assert edges[0] == lo and edges[-1] == hi
        assert all(math.isclose(b / a, math.sqrt(2)) for a, b in zip(edges, edges[1:]))
    counts = {p.get_label().split(";")[0]: int(p.get_data().values.sum()) for p in ax.patches}
    assert counts == {"reasoning (per turn)": 2, "answer (per turn)": 2, "whole row": 3}
    assert any("2 of 0 tokens, not shown" in p.get_label() for p in ax.patches)
    plt.close(fig)
    hist.plot(tmp_path / "token_lengths.png", estimated_reasoning=True)
    assert (tmp_path / "token_lengths.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_merged_histograms_keep_every_count_and_the_axis_follows_them():
    a, b = LengthHistograms(32768), LengthHistograms(32768)
    a.add("row", [5000])
    b.add("row", [20000, 32768, 40000])  # over max_length: counted in the top bin
    b.add("reasoning", [0])
    a.merge(b)
    assert int(a.counts["row"].sum()) == 4 and a.zeros["reasoning"] == 1
    fig, ax = drawn(a)
    lo, hi = ax.get_xlim()
    assert 5000 / math.sqrt(2) <= lo <= 5000 and 32768 <= hi <= 32768 * math.sqrt(2), (lo, hi)
    plt.close(fig)
