"""pass 1's quick path for plain ShareGPT records (prepare.turns=first) gives exactly what the general path gives:
same digest, same prompt, same reason when a record is dropped."""
import json

from drafter_data.prompts.malformed import Malformed
from drafter_data.prompts.candidate import normalize_record, plain_first_turn, plain_prompt_digest
from tests.conftest import PROMPT_FIXTURES, require_shared

UNIT = {"fields": {}, "format": "auto"}
CRAFTED = [
    {"conversations": [{"from": "human", "value": "plain"}]},
    {"conversations": [{"from": "user", "value": "é \u2028 \"quoted\" \\ \n\t\x00 \U0001F600"}]},
    {"conversations": [{"from": "human", "value": "   \n"}]},
    {"conversations": [{"from": "human", "value": ""}]},
    {"conversations": [{"from": "human", "value": "x" * 50}]},
    {"conversations": [{"from": "prompter", "value": "q"}, {"from": "human", "value": "next"}]},
    {"conversations": [{"from": "human", "value": "q"}], "system": "sys"},
    {"conversations": [{"from": "human", "value": "q"}], "tools": "[]"},
    {"conversations": [{"from": " Human ", "value": "q"}]},
    {"conversations": [{"from": "human", "value": None}]},
    {"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "q"}]},
    {"conversations": []},
    {"messages": [{"from": "human", "value": "q"}]},
]


def outcome(fn):
    try:
        return fn()
    except Malformed as exc:
        return exc.args[0]


def fixture_records():
    for name in ("sharegpt_v3_sample.json", "glaive_toolcall_en_demo.json"):
        yield from json.loads(require_shared(PROMPT_FIXTURES / name).read_text())
    for line in require_shared(PROMPT_FIXTURES / "numina_cot_sharegpt_data_1k.jsonl").read_text().splitlines():
        yield json.loads(line)


def test_the_quick_path_matches_the_general_path():
    quick = 0
    for max_chars in (None, 40):
        pcfg = {"turns": "first", "max_prompt_chars": max_chars}
        for record in [*CRAFTED, *fixture_records()]:
            text = plain_first_turn(record)
            if text is None:
                continue
            quick += 1
            general = outcome(lambda: normalize_record(record, b"", UNIT, pcfg))
            fast = outcome(lambda: (plain_prompt_digest(text, max_chars, None, None),
                                    [{"role": "user", "content": text}], None, None, 1))
            assert fast == general, record
    assert quick > 2000  # it is the path most records take
