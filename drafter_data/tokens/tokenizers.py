"""Target tokenizers. Each kind encodes rendered chat text exactly as its reference does, special-token spellings
included, and can say where a character position falls in the token sequence (for loss masks).

kinds: kimi_tiktoken (Kimi K2.x: tiktoken.model + tokenizer_config.json), hf_tokenizers (a tokenizer.json, e.g.
Qwen), server (the running llama-server's own /tokenize: the serving engine's tokens, nothing re-implemented).
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path

import numpy as np

from drafter_data.errors import StageError

KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
KIMI_NUM_RESERVED = 256
RESERVED_SPELLING = "<|reserved_token_"  # + id + "|>": the spelling of a special id without a name
MAX_CHUNK_CHARS = 400_000  # the reference cuts text into chunks of this many characters before BPE
MAX_RUN_CHARS = 25_000  # ... and cuts runs of whitespace / non-whitespace longer than this
_RUNS = re.compile(r"\s+|\S+")


def _require(path: Path, what: str) -> Path:
    if not path.is_file():
        raise StageError(f"{what} not found: {path} (target.tokenizer_dir must be the model directory holding it)")
    return path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split_long_runs(text: str) -> list[str]:
    """The reference's cut of a chunk so no piece holds more than MAX_RUN_CHARS consecutive whitespace or
    non-whitespace characters; cut positions counted from the chunk start. Fast path: short text is never cut."""
    if len(text) <= MAX_RUN_CHARS:
        return [text]
    cuts = []
    for run in _RUNS.finditer(text):
        start, end = run.span()
        cuts.extend(range(start + MAX_RUN_CHARS, end, MAX_RUN_CHARS))
    if not cuts:
        return [text]
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def may_be_cut(text: str) -> bool:
    """Whether the reference's chunking or run cut could split `text` (False is exact: a run longer than
    MAX_RUN_CHARS covers a whole aligned window of half that length, and here every such window holds a space or
    newline and a non-space). Checked at memchr speed, unlike split_long_runs' regex pass."""
    if len(text) <= MAX_RUN_CHARS:
        return False
    if len(text) > MAX_CHUNK_CHARS:
        return True
    width = MAX_RUN_CHARS // 2
    for start in range(0, len(text) - width + 1, width):
        window = text[start:start + width]
        if not ((" " in window or "\n" in window) and not window.isspace()):
            return True
    return False


class KimiTokenizer:
    """tiktoken BPE with the K2.x ranks, pre-tokenization regex and 256-id special block, plus the reference's
    chunking and its handling of special-token text inside content (the transformers slow-tokenizer path)."""

    kind = "kimi_tiktoken"

    def __init__(self, tokenizer_dir: str | Path, literal_ids: frozenset[int] = frozenset()):
        import tiktoken

        directory = Path(tokenizer_dir)
        model = _require(directory / "tiktoken.model", "tiktoken.model")
        config = json.loads(_require(directory / "tokenizer_config.json", "tokenizer_config.json").read_text())
        ranks = {}
        with open(model, "rb") as fh:
            for line in fh:
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
        n_base = len(ranks)
        named = {int(i): tok["content"] for i, tok in config.get("added_tokens_decoder", {}).items()}
        self.specials = {named.get(i, f"{RESERVED_SPELLING}{i}|>"): i
                         for i in range(n_base, n_base + KIMI_NUM_RESERVED)}
        self.id_to_special = {i: s for s, i in self.specials.items()}
        self.vocab_size = n_base + KIMI_NUM_RESERVED
        self.files_sha256 = {"tiktoken.model": sha256_file(model)}
        self.special_tokens_map = {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                                   if isinstance(config.get(k), str)}
        self.bos_id = self.specials.get(config.get("bos_token"))
        self.eos_id = self.specials.get(config.get("eos_token"))
        self.pad_id = self.specials.get(config.get("pad_token"))
        self._enc = tiktoken.Encoding(name=f"kimi-{directory.name}", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                      special_tokens=self.specials)
        # Text spelled like these ids is encoded as plain text (e.g. the spelling of the id chosen as mask token).
        self.literal_specials = frozenset(self.id_to_special[i] for i in literal_ids if i in self.id_to_special)
        self._allowed = frozenset(s for s in self.specials if s not in self.literal_specials)
        # tiktoken converts the allowed set on every call (~28 us for all 256, ~5% of a 2,000-token text); text
        # without the reserved ids' spelling can only hold the named ones, which is the same result from a set of 23
        self._allowed_named = frozenset(s for s in self._allowed if not s.startswith(RESERVED_SPELLING))
        added = sorted((s for s in named.values() if s not in self.literal_specials), key=len, reverse=True)
        self._added_re = re.compile("(" + "|".join(map(re.escape, added)) + ")") if added else None
        self._added_ids = {s: self.specials[s] for s in added}
        self._added_endings = tuple(added)
        self.think_end_id = self.specials.get("</think>")

    @property
    def name(self) -> str:
        return self._enc.name

    def encode(self, text: str, allow_special_tokens: bool = False) -> list[int]:
        """The reference `encode`: 400k-char chunks, long runs cut, then BPE; special spellings are ids only when
        allowed."""
        ids: list[int] = []
        for c in range(0, len(text), MAX_CHUNK_CHARS):
            for piece in split_long_runs(text[c: c + MAX_CHUNK_CHARS]):
                if allow_special_tokens:
                    ids += self._enc.encode(piece, allowed_special=self._allowed_in(piece), disallowed_special=())
                else:
                    ids += self._enc.encode_ordinary(piece)
        return ids

    def encode_chat(self, text: str) -> list[int]:
        """As `apply_chat_template(tokenize=True)`: split on the named added tokens, encode the pieces between with
        every special spelling allowed (so `<|reserved_token_N|>` in content becomes id N, as in the reference)."""
        if self._added_re is None or not may_be_cut(text):
            # No piece can be cut here, and tiktoken splits at every allowed special spelling exactly as the
            # named-token split + per-piece encode does: one call gives the same ids, faster.
            return self._enc.encode(text, allowed_special=self._allowed_in(text), disallowed_special=())
        ids: list[int] = []
        for i, part in enumerate(self._added_re.split(text)):
            if i % 2:
                ids.append(self._added_ids[part])
            elif part:
                ids += self.encode(part, allow_special_tokens=True)
        return ids

    def encode_chat_np(self, text: str) -> np.ndarray:
        """encode_chat as an int32 array (straight into numpy, no Python list of ints, for text that is never cut)."""
        if self._added_re is None or not may_be_cut(text):
            ids = self._enc.encode_to_numpy(text, allowed_special=self._allowed_in(text), disallowed_special=())
            return ids.astype(np.int32)
        return np.asarray(self.encode_chat(text), dtype=np.int32)

    def encode_chat_split(self, text: str, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids of text[:pos], ids of text[pos:]). Where text[:pos] ends with a named added token (a generation
        prompt does), the reference splits there anyway: one call over the whole text, cut after the same number of
        that token's ids as its spelling occurs before pos (each spelling is exactly one id)."""
        end = self._added_token_ending(text, pos)
        if end is None:
            return self.encode_chat_np(text[:pos]), self.encode_chat_np(text[pos:])
        ids = self.encode_chat_np(text)
        cut = int(np.flatnonzero(ids == self._added_ids[end])[text.count(end, 0, pos) - 1]) + 1
        return ids[:cut], ids[cut:]

    def _allowed_in(self, text: str) -> frozenset[str]:
        return self._allowed if RESERVED_SPELLING in text else self._allowed_named

    def _added_token_ending(self, text: str, pos: int) -> str | None:
        """The named added token text[:pos] ends with (the longest), if any; without copying text[:pos]."""
        if not pos or not text.endswith(self._added_endings, 0, pos):
            return None
        return next(s for s in self._added_ids if text.endswith(s, 0, pos))

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)


class HFTokenizer:
    """A `tokenizer.json` (Hugging Face `tokenizers`), e.g. Qwen; added tokens are split out by the library itself."""

    kind = "hf_tokenizers"

    def __init__(self, tokenizer_dir: str | Path, literal_ids: frozenset[int] = frozenset()):
        from tokenizers import Tokenizer

        directory = Path(tokenizer_dir)
        path = _require(directory / "tokenizer.json", "tokenizer.json")
        self._tok = Tokenizer.from_file(str(path))
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.files_sha256 = {"tokenizer.json": sha256_file(path)}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_tokens_map = {k: v for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                                   if isinstance(v := config.get(k), str)}
        self.bos_id, self.eos_id, self.pad_id = (self._tok.token_to_id(self.special_tokens_map.get(k, "")) for k in
                                                 ("bos_token", "eos_token", "pad_token"))
        self.literal_specials = frozenset()  # spellings of special ids in text become the ids; callers check
        self.chat_template_in_config = config.get("chat_template")
        self.name = directory.name
        think_end = self.encode_chat("</think>")
        self.think_end_id = think_end[0] if len(think_end) == 1 else None

    def encode_chat(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_chat_np(self, text: str) -> np.ndarray:
        return np.asarray(self.encode_chat(text), dtype=np.int32)

    def encode_chat_split(self, text: str, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids of text[:pos], ids of text[pos:]), each tokenized on its own (as the server tokenizes a prompt)."""
        return self.encode_chat_np(text[:pos]), self.encode_chat_np(text[pos:])

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


class ServerTokenizer:
    """The serving engine's own tokenizer (llama-server /tokenize): tokens exactly as the server sees the text.
    Also the way to cross-check a re-implemented tokenizer against a real K2.6 deployment."""

    kind = "server"

    def __init__(self, root: str, literal_ids: frozenset[int] = frozenset(), timeout: float = 60.0):
        """root: the server's root URL (where /tokenize lives, without /v1)."""
        import httpx2

        self.root = root
        self._http = httpx2.Client(timeout=timeout)
        self.literal_specials = frozenset()  # spellings of special ids in text become the ids; callers check
        props = self._get("/props")
        self.name = str(props.get("model_alias") or props.get("model_path") or "server")
        self.special_tokens_map = {"bos_token": props.get("bos_token", ""), "eos_token": props.get("eos_token", "")}
        self.bos_id = self._single_id(self.special_tokens_map["bos_token"])
        self.eos_id = self._single_id(self.special_tokens_map["eos_token"])
        self.pad_id = None
        self.think_end_id = self._single_id("</think>")
        self.vocab_size = self._vocab_size()
        model_path = Path(str(props.get("model_path") or ""))
        self.files_sha256 = {model_path.name: sha256_file(model_path)} if model_path.is_file() else {}

    def _get(self, path: str) -> dict:
        return self._request("GET", path)

    def _post(self, path: str, body: dict) -> dict:
        return self._request("POST", path, body)

    def _request(self, method: str, path: str, body: dict | None = None, attempts: int = 3) -> dict:
        """One clear StageError when the server cannot tokenize (down, unreachable, failing), after a short retry:
        every row would fail the same way, so the run stops instead of dropping them one by one."""
        import time

        import httpx2

        for attempt in range(attempts):
            try:
                resp = self._http.request(method, self.root + path, json=body)
            except httpx2.TransportError as exc:
                problem = f"unreachable ({type(exc).__name__}: {exc})"
            else:
                if resp.status_code == 404:
                    raise StageError(f"{self.root}{path} is not served: the server tokenizer needs llama-server's "
                                     f"/tokenize and /apply-template endpoints")
                if resp.status_code < 500:
                    resp.raise_for_status()
                    return resp.json()
                problem = f"failing (HTTP {resp.status_code})"
            if attempt + 1 < attempts:
                time.sleep(0.5 * (attempt + 1))
        raise StageError(f"the server tokenizer at {self.root} is {problem}; target.tokenizer=server needs the "
                         f"target's server running (server.base_url)")

    def _single_id(self, text: str) -> int | None:
        if not text:
            return None
        ids = self._post("/tokenize", {"content": text, "add_special": False, "parse_special": True})["tokens"]
        return ids[0] if len(ids) == 1 else None

    def _vocab_size(self) -> int | None:
        try:
            meta = self._get("/v1/models")["data"][0].get("meta", {})
            return meta.get("n_vocab")
        except Exception:  # noqa: BLE001 - informative only
            return None

    def apply_template(self, messages: list[dict], **template_kwargs) -> str:
        return self._post("/apply-template", {"messages": messages, "chat_template_kwargs": template_kwargs})["prompt"]

    def encode_chat(self, text: str) -> list[int]:
        return self._post("/tokenize", {"content": text, "add_special": False, "parse_special": True})["tokens"]

    def encode_chat_np(self, text: str) -> np.ndarray:
        return np.asarray(self.encode_chat(text), dtype=np.int32)

    def encode_chat_split(self, text: str, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids of text[:pos], ids of text[pos:]), each tokenized on its own (as the server tokenizes a prompt)."""
        return self.encode_chat_np(text[:pos]), self.encode_chat_np(text[pos:])

    def decode(self, ids: list[int]) -> str:
        return self._post("/detokenize", {"tokens": ids})["content"]


def load_tokenizer(target, server_root: str | None = None, literal_ids: frozenset[int] = frozenset()):
    """literal_ids: special ids whose spelling inside text is encoded as plain text, where the kind can
    (kimi_tiktoken); elsewhere such text still becomes the id and callers must check for it.
    server_root: the running server's root URL, for target.tokenizer=server."""
    kind = target.tokenizer
    if kind == "kimi_tiktoken":
        return KimiTokenizer(_tokenizer_dir(target), literal_ids)
    if kind == "hf_tokenizers":
        return HFTokenizer(_tokenizer_dir(target), literal_ids)
    if kind == "server":
        if not server_root:
            raise StageError("target.tokenizer=server needs a running server (server.base_url)")
        return ServerTokenizer(server_root, literal_ids)
    raise StageError(f"unknown target.tokenizer {kind!r}: use kimi_tiktoken, hf_tokenizers or server")


def _tokenizer_dir(target) -> Path:
    if not target.get("tokenizer_dir"):
        raise StageError(f"target {target.name}: set target.tokenizer_dir to the model directory with its tokenizer")
    directory = Path(target.tokenizer_dir)
    if not directory.is_dir():
        raise StageError(f"target.tokenizer_dir {directory.resolve()} does not exist; point it at the model "
                         f"directory holding the tokenizer files and chat_template.jinja")
    return directory
