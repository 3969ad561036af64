"""Chat-template renders reused across rows of one *shape*: a row's messages with every free-text value (contents,
reasoning, tool-call arguments and ids, names) replaced by a numbered slot. A template that only writes those values
out verbatim renders every row of a shape as the same scaffolding with the values pasted into the slots, so the
jinja render (as costly as the tokenizing) runs once per shape instead of twice per row.

Exactness, checked before a shape is trusted (at its second row; the first is rendered in full):
- the skeleton is rendered with slots that log every read other than being written out (`in`, comparisons, methods
  such as startswith or strip, filters such as trim or length, indexing): a template that reads one is not cached;
- a probe row, whose values hold what an escaping or content-reading template reacts to (whitespace at both ends,
  quotes, backslashes, think tags, special-token text), is rendered in full and must equal its pasted text (this
  catches `tojson`, which copies a string without calling it);
- the second row itself is rendered in full and must equal its pasted text, else the cache is off for good.
Values are pasted only where non-empty (a template may test them for truth), text spelling a slot marker is never
cached, and templates that read the clock are never cached.

These checks cannot see every read: a value first turned into a plain string (by a macro's output, `~`, `|join`,
`|format`, `|replace`) or used as a dict key is read unlogged, and a row that takes another branch later would be
pasted wrong. So the cache runs only for templates read line by line and found to write every free text out as is
(CHECKED_TEMPLATES, by the template's sha256); any other template is rendered in full for every row.
"""
from __future__ import annotations

import hashlib
import re
from collections import OrderedDict

import orjson

# The keys whose non-empty string values are free text; role, type and everything else stay part of the shape.
FREE_TEXT_KEYS = frozenset({"content", "reasoning_content", "reasoning", "text", "arguments", "id", "tool_call_id",
                            "name"})
FREE_TEXT_KWARGS = ("tools_ts_str",)
_OPEN, _CLOSE = "\U000f0000", "\U000f0001"  # supplementary private use: no template or tokenizer text holds them
_SLOT = re.compile(f"{_OPEN}(\\d+){_CLOSE}")
_OPEN_BYTES = _OPEN.encode()
PROBE = " \n<think>{i}\"'\\</think>\t<|im_end|>{{{{ x }}}} \n"
_UNSEEN, _SEEN_ONCE = object(), "seen once"
# Templates whose every free text is only written out (checked by reading them), by sha256 of their source.
CHECKED_TEMPLATES = {
    # Kimi K2.6 (and K2): contents, names, reasoning and tool-call ids and arguments go out as they are (or through
    # tojson where arguments are not a string: not a free text, so part of the shape); `name or role` tests a name
    # for truth only.
    "8bf859698fd4781c0e1e1c63ce74422aab27e53ccc5f47116317c64cda06132f": "Kimi K2.6",
}
# Shapes remembered (the oldest dropped) and the largest one cached (e.g. a big literal tools list): memory stays flat.
MAX_SHAPES = 1024
MAX_SHAPE_BYTES = 8192


def _slot(i: int) -> str:
    return f"{_OPEN}{i}{_CLOSE}"


def hollow_kwargs(kwargs: dict, values: list) -> dict:
    out = dict(kwargs)
    for key in FREE_TEXT_KWARGS:
        if type(out.get(key)) is str and out[key]:
            out[key] = _slot(len(values))
            values.append(kwargs[key])
    return out


def hollow(value, values: list):
    """`value` with each non-empty free-text string replaced by the next slot (its text appended to `values`)."""
    if type(value) is dict:
        out = {}
        for key, item in value.items():
            if key in FREE_TEXT_KEYS and type(item) is str and item:
                out[key] = _slot(len(values))
                values.append(item)
            else:
                out[key] = hollow(item, values)
        return out
    if type(value) is list:
        return [hollow(item, values) for item in value]
    return value


def refill(value, values: list):
    """The inverse of hollow: every slot string replaced by its value."""
    if type(value) is dict:
        return {key: refill(item, values) for key, item in value.items()}
    if type(value) is list:
        return [refill(item, values) for item in value]
    if type(value) is str and value.startswith(_OPEN):
        return values[int(value[1:-1])]
    return value


_READS = ("__contains__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__len__", "__getitem__",
          "__iter__", "__add__", "__radd__", "__mul__", "__rmul__", "__mod__", "__rmod__", "__format__")


def logging_slot_type(log: list) -> type:
    """A str type whose instances append to `log` whatever a template does with them beyond writing them out (str()
    and a truth test, always true here, are not reads)."""

    def read(name):
        def method(self, *args):
            log.append(name)
            return str(self) + args[0] if name == "__radd__" else getattr(str, name)(self, *args)
        return method

    def attribute(self, name):
        log.append(name)
        return str.__getattribute__(self, name)

    namespace = {name: read(name) for name in _READS}
    namespace.update(__getattribute__=attribute, __bool__=lambda self: True, __hash__=str.__hash__)
    return type("LoggingSlot", (str,), namespace)


def recipe(text: str) -> tuple | None:
    """A skeleton render as literal pieces and slot numbers; None when a marker is left over (a value was cut)."""
    parts = _SLOT.split(text)
    pieces = tuple(int(p) if i % 2 else p for i, p in enumerate(parts) if i % 2 or p)
    if any(type(p) is str and (_OPEN in p or _CLOSE in p) for p in pieces):
        return None
    return pieces


def paste(pieces: tuple, values: list) -> str:
    return "".join([p if type(p) is str else values[p] for p in pieces])


class RenderCache:
    """(the prompt with the generation prompt, the conversation with the answer) for one request, as
    `render(messages, add_generation_prompt, kwargs)` writes them, through the cache where a shape is trusted."""

    def __init__(self, render, template_source: str):
        self._render = render
        checked = hashlib.sha256(template_source.encode()).hexdigest() in CHECKED_TEMPLATES
        self.enabled = checked and "strftime_now" not in template_source  # a skeleton would keep its render's date
        # shape -> (prompt recipe, full recipe); _SEEN_ONCE: its next row decides; None: always rendered in full
        self._shapes: OrderedDict[bytes, tuple | str | None] = OrderedDict()
        self.pasted = 0  # rows served from the cache

    def texts(self, messages: list[dict], answer: dict, kwargs: dict) -> tuple[str, str]:
        if not self.enabled:
            return self.render_both(messages, answer, kwargs)
        values: list[str] = []
        shape_messages, shape_kwargs = hollow(messages + [answer], values), hollow_kwargs(kwargs, values)
        try:
            key = orjson.dumps([shape_messages, shape_kwargs])
        except TypeError:
            return self.render_both(messages, answer, kwargs)
        if len(key) > MAX_SHAPE_BYTES or key.count(_OPEN_BYTES) != len(values):  # or the row spells a slot marker
            return self.render_both(messages, answer, kwargs)
        recipes = self._shapes.get(key, _UNSEEN)
        if recipes is _UNSEEN or recipes is None:
            if recipes is _UNSEEN:
                self._remember(key, _SEEN_ONCE)
            return self.render_both(messages, answer, kwargs)
        if recipes is _SEEN_ONCE:  # remembered only once this row's full render agreed (a render that raises: next row)
            recipes = self._learn(shape_messages, shape_kwargs, len(values))
            rendered = self._verified(recipes, values, messages, answer, kwargs)
            self._remember(key, recipes)
            return rendered
        self.pasted += 1
        return paste(recipes[0], values), paste(recipes[1], values)

    def render_both(self, messages: list[dict], answer: dict, kwargs: dict) -> tuple[str, str]:
        return self._render(messages, True, kwargs), self._render(messages + [answer], False, kwargs)

    def _remember(self, key: bytes, entry) -> None:
        self._shapes[key] = entry
        if len(self._shapes) > MAX_SHAPES:
            self._shapes.popitem(last=False)

    def _learn(self, shape_messages: list, shape_kwargs: dict, n_values: int) -> tuple | None:
        """The shape's (prompt, full) recipes, or None when the template does not paste its values verbatim."""
        try:
            reads: list[str] = []
            slot_type = logging_slot_type(reads)
            slots = [slot_type(_slot(i)) for i in range(n_values)]
            messages, kwargs = refill(shape_messages, slots), refill(shape_kwargs, slots)
            recipes = (recipe(self._render(messages[:-1], True, kwargs)), recipe(self._render(messages, False, kwargs)))
            if reads or None in recipes:
                return None
            probe = [PROBE.format(i=i) for i in range(n_values)]
            messages, kwargs = refill(shape_messages, probe), refill(shape_kwargs, probe)
            rendered = self.render_both(messages[:-1], messages[-1], kwargs)
        except Exception:  # noqa: BLE001 - a template that fails on the skeleton or the probe: render rows in full
            return None
        return recipes if rendered == (paste(recipes[0], probe), paste(recipes[1], probe)) else None

    def _verified(self, recipes: tuple | None, values: list, messages: list, answer: dict,
                  kwargs: dict) -> tuple[str, str]:
        """The row rendered in full; a pasted text that differs turns the cache off for the rest of the run."""
        rendered = self.render_both(messages, answer, kwargs)
        if recipes is not None and rendered != (paste(recipes[0], values), paste(recipes[1], values)):
            self.enabled = False
        return rendered
