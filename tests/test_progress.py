"""generate's progress: a bar that fits 120 columns, a line every so often without a terminal, and a throughput plot
that reads right for unstreamed answers."""
import io
import re

import numpy as np

from drafter_data.generation.progress import Assessment, Counters, Progress, smoothed


class Terminal(io.StringIO):
    def isatty(self):
        return True


def busy_progress(stream) -> Progress:
    counters = Counters(done=123_456, errors=12_345, retries=987_654, output_tokens=987_654_321)
    progress = Progress(counters, Assessment(tokens_per_s=812.5, concurrency=256))
    progress.start(4_300_000, stream=stream)
    progress.t0 -= 20 * 86400  # twenty days into the run
    progress.client.bound_s, progress.client.cores = 10.0, 0.98  # the client at its ceiling
    return progress


def test_the_bar_fits_120_columns_with_its_bar_whole():
    progress = busy_progress(Terminal())
    progress.update(1_234_567, 256)
    line = str(progress.bar)
    assert len(line) <= 120, (len(line), line)
    bar = re.search(r"\|(.*?)\|", line).group(1)
    assert len(bar) == 16 and "c=256" in line and "CLIENT-BOUND" in line


def test_without_a_terminal_a_line_is_written_every_so_often():
    log = io.StringIO()
    progress = busy_progress(log)
    assert progress.bar is None
    progress.log_every_s = 0.0
    progress.update(10, 64)
    progress.update(20, 64)
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].startswith("generate: 20/4300000 conversations, c=64 ")
    progress.log_every_s = 3600.0
    progress.update(30, 64)
    assert len(log.getvalue().splitlines()) == 2


def test_unstreamed_answers_plot_as_a_steady_rate_not_a_sawtooth():
    t = np.arange(5.0, 605.0, 5.0)
    rate = np.where(np.arange(len(t)) % 2 == 0, 0.0, 800.0)  # answers land in every other 5 s point
    steady = smoothed(t, rate)[12:]  # past the first minute
    assert np.all(np.abs(steady - 400.0) <= 40.0), steady
    assert np.allclose(smoothed(t, np.full(len(t), 300.0)), 300.0)
