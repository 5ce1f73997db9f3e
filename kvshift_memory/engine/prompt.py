"""Turning messages and memories into token ids, with each memory's tokens as a separate span.

The chat template is rendered once with a sentinel in place of every content string; the rendered
text is split at the sentinels. Template pieces are tokenised with special tokens recognised, and
content (messages and memories) with special tokens *split*, so a message that contains
``<|im_start|>`` stays text and can never forge turn structure. Tokenising piecewise also gives each
memory the same token ids in every prompt, which is what lets its KV be reused.

Memories given to the engine go inside the system message, after ``memory_header``, one per line::

    <system prompt>\\n\\n<memory header>\\n<memory 1>\\n<memory 2>\\n...

A user message may bring memories of its own (the agent's recall for that turn); they go before
its content, introduced by the same header::

    <memory header>\\n<memory 1>\\n...\\n\\n<content>

or, with ``"memories_at"``, at that offset of its content (or each at its own offset), without a
header: a framework's flat prompt, whose own text introduces them.

Either way a memory's fragment is encoded after the same *conditioning*: the system message up to
where its memories would start, so one fragment serves both places.

Chat templates differ in where a system message goes (:func:`template_style`). One without a
system role (Gemma 2), or one that moves it (Mistral folds it into the *last* user turn, so it
would move every turn and no prompt would share a prefix with the last), gets the system message
folded into the first user turn by us: memories stay at one place, turn after turn. A model with no
template (a base model) gets a plain transcript.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from ..chat_turns import ToolLayout, as_text_turns
from ..exceptions import InvalidInputError
from ..messages import Message

__all__ = [
    "FragmentSpan",
    "PromptLayout",
    "ScopedTokens",
    "TemplateStyle",
    "TokenMemo",
    "build_layout",
    "common_prefix",
    "digest_ids",
    "template_style",
    "tool_layout",
]


#: ``"system"``: the template renders a system message first; ``"fold"``: the system message goes
#: into the first user turn (no system role, or a template that would move it); ``"plain"``: no
#: template, a plain transcript
TemplateStyle = Literal["system", "fold", "plain"]

# what a tool field may hold and still be written by the template as it is: no character a
# template token is made of (``<|im_end|>``, ``[INST]``, ``<start_of_turn>``), no line break
_PLAIN_FIELD = re.compile(r"[\w .,:;/=+\-'()?!@#%&*]*")


def digest_ids(ids: Sequence[int]) -> str:
    """A stable digest of a token id sequence."""
    return hashlib.blake2b(
        torch.as_tensor(list(ids), dtype=torch.int64, device="cpu").numpy().tobytes(), digest_size=16
    ).hexdigest()


@dataclass(frozen=True)
class FragmentSpan:
    """Where one memory's tokens sit in the prompt: slots ``[start, end)``."""

    start: int
    end: int
    text: str
    token_ids: tuple[int, ...]
    record: Any = field(default=None, compare=False)  # the memory record it came from, when not plain text
    #: the ids of the encode context its fragment is encoded after, between the conditioning and it
    context: tuple[int, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class PromptLayout:
    """A tokenised prompt: all ids, the memory spans inside it, and what fragments are encoded after.

    :param conditioning: the ids fragments are encoded after (the system message up to where its
        memories start); a prompt begins with ``anchor_length`` of them. Between the two each span
        has its own encode context (``FragmentSpan.context``, never in the prompt itself); a lead
        fragment is encoded after the conditioning alone.
    :param tenant: whose prompt this is: the engine reuses K/V only from prompts
        and fragments of the same tenant.
    :param default_conditioning: the conditioning of the engine's own system message, which
        fragments warmed with no system message known are encoded after: a fragment not cached
        after this prompt's conditioning is looked up after it (:meth:`under_default`), and
        shifted and repaired like any other.
    """

    token_ids: torch.Tensor
    fragments: tuple[FragmentSpan, ...]
    conditioning: torch.Tensor
    tenant: str = ""
    default_conditioning: torch.Tensor | None = None
    _digests: dict[tuple[int, ...], str] = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def length(self) -> int:
        return int(self.token_ids.numel())

    @property
    def anchor_length(self) -> int:
        """Leading tokens shared with the conditioning: the attention sinks every prompt starts with."""
        return common_prefix(self.token_ids, self.conditioning)

    @property
    def tail_start(self) -> int:
        """First slot after the last memory."""
        return self.fragments[-1].end if self.fragments else self.length

    def under_default(self) -> PromptLayout | None:
        """This layout with fragments looked up after the default conditioning, or ``None`` when
        its own conditioning is that one (or none is known)."""
        default = self.default_conditioning
        if default is None or torch.equal(default, self.conditioning):
            return None
        return replace(self, conditioning=default, default_conditioning=None)

    def encoded_after(self, span: FragmentSpan, lead: bool = False) -> torch.Tensor:
        """What ``span``'s fragment is encoded after: the conditioning, then its encode context unless ``lead``."""
        if lead or not span.context:
            return self.conditioning
        return torch.cat([self.conditioning, torch.tensor(span.context, dtype=torch.long, device="cpu")])

    def context_digest(self, span: FragmentSpan, lead: bool = False) -> str:
        """The digest of :meth:`encoded_after`, which keys the fragments encoded after it."""
        context = () if lead else span.context
        digest = self._digests.get(context)
        if digest is None:  # looked up for every memory of a prompt, most sharing one context: hashed once per layout
            digest = self._digests[context] = digest_ids(self.encoded_after(span, lead).tolist())
        return digest


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


class TokenMemo:
    """A tokenizer with the ids of recently tokenised texts kept.

    The same memories, system prompt and window turns come back in every prompt of a session;
    tokenising a 2k-token memory set again costs milliseconds of the user's wait for the first token.

    Texts are kept per tenant: a text one tenant sent never makes another
    tenant's call faster, so timing cannot tell one what another typed.

    It also keeps the ids of the replies the engine generated (:meth:`remember_reply`): a reply
    that comes back as text in the next turn's messages is read as the ids the model wrote, which
    the cached K/V holds, where the tokenizer may split the same text otherwise. A framework that
    carries only the text (LlamaIndex's memory, a chat store) still reuses the whole reply.

    :param tokenizer: a transformers tokenizer.
    :param capacity_ids: the most token ids kept over all texts, and again over all replies
        (least recently used go first).
    """

    def __init__(self, tokenizer: Any, capacity_ids: int = 1 << 18) -> None:
        self.tokenizer = tokenizer
        #: how the tokenizer's chat template places a system message
        self.style: TemplateStyle = template_style(tokenizer)
        #: how tools, calls and results are written for this model
        self.tool_layout: ToolLayout = tool_layout(tokenizer)
        self.capacity_ids = capacity_ids
        self._ids: OrderedDict[tuple[str, str, bool], tuple[int, ...]] = OrderedDict()
        self._replies: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()
        self._held = 0
        self._replies_held = 0
        self._lock = threading.Lock()

    def scoped(self, tenant: str) -> ScopedTokens:
        """This memo as one tenant sees it (what :func:`build_layout` is given)."""
        return ScopedTokens(self, tenant)

    def encode(self, text: str, *, split_special: bool = True, tenant: str = "") -> tuple[int, ...]:
        """The ids of ``text`` without added special tokens; with ``split_special``, a special
        token's text inside it (``<|im_start|>``) is split into ordinary tokens."""
        key = (tenant, text, split_special)
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
                return ids
        ids = tuple(self.tokenizer(text, add_special_tokens=False, split_special_tokens=split_special)["input_ids"])
        with self._lock:
            if key not in self._ids and len(ids) <= self.capacity_ids:
                self._ids[key] = ids
                self._held += len(ids)
                while self._held > self.capacity_ids:
                    _, dropped = self._ids.popitem(last=False)
                    self._held -= len(dropped)
        return ids

    def remember_reply(self, text: str, ids: Sequence[int], *, tenant: str = "") -> None:
        """Keep the ids the model generated for the reply ``text`` (in ``tenant`` only)."""
        if not text or not ids or len(ids) > self.capacity_ids:
            return
        key = (tenant, text)
        with self._lock:
            dropped = self._replies.pop(key, ())
            self._replies[key] = tuple(ids)
            self._replies_held += len(ids) - len(dropped)
            while self._replies_held > self.capacity_ids:
                _, dropped = self._replies.popitem(last=False)
                self._replies_held -= len(dropped)

    def reply_ids(self, text: str, *, tenant: str = "") -> tuple[int, ...] | None:
        """The ids the model generated for the reply ``text`` in ``tenant``, if kept."""
        with self._lock:
            ids = self._replies.get((tenant, text))
            if ids is not None:
                self._replies.move_to_end((tenant, text))
            return ids


@dataclass(frozen=True)
class ScopedTokens:
    """A :class:`TokenMemo` seen from one tenant: its texts are remembered for that tenant only."""

    memo: TokenMemo
    tenant: str

    @property
    def tokenizer(self) -> Any:
        return self.memo.tokenizer

    @property
    def style(self) -> TemplateStyle:
        return self.memo.style

    @property
    def tool_layout(self) -> ToolLayout:
        return self.memo.tool_layout

    def encode(self, text: str, *, split_special: bool = True) -> tuple[int, ...]:
        return self.memo.encode(text, split_special=split_special, tenant=self.tenant)

    def reply_ids(self, text: str) -> tuple[int, ...] | None:
        return self.memo.reply_ids(text, tenant=self.tenant)


def template_style(tokenizer: Any) -> TemplateStyle:
    """How ``tokenizer``'s chat template places a system message, found by rendering a probe
    conversation (system, user, assistant, user) with marked contents."""
    if not getattr(tokenizer, "chat_template", None):
        return "plain"
    marks = {role: f"\x00probe-{role}\x00" for role in ("system", "user", "assistant", "again")}
    turns = [("user", marks["user"]), ("assistant", marks["assistant"]), ("user", marks["again"])]
    conversation = [{"role": role, "content": content} for role, content in turns]
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "system", "content": marks["system"]}, *conversation], tokenize=False, add_generation_prompt=True
        )
    except Exception:  # a template that refuses the system role raises whatever its author chose
        return "fold"
    at = rendered.find(marks["system"])
    return "system" if 0 <= at < rendered.find(marks["user"]) else "fold"


_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "kvshift_probe",
        "description": "kvshift probe tool",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}
_PROBE_CALLS: dict[str, ToolLayout] = {
    '<tool_call>\n{"name": "kvshift_probe", "arguments": {"q": "x"}}\n</tool_call>': "hermes",
    '{"name": "kvshift_probe", "parameters": {"q": "x"}}': "llama-json",
}


def tool_layout(tokenizer: Any) -> ToolLayout:
    """How tools reach this model (:data:`~kvshift_memory.chat_turns.ToolLayout`), found by
    rendering a probe conversation (a tool, a call to it, its result) with the chat template: a
    template that writes the tool's description and the call in a format we read renders them;
    any other (no template, one that ignores ``tools=`` or refuses the probe, a call format we do
    not read) gets our own layout, as text."""
    if not getattr(tokenizer, "chat_template", None):
        return "kvshift"
    call = {"id": "kvshift01", "type": "function", "function": {"name": "kvshift_probe", "arguments": {"q": "x"}}}
    probe = [
        {"role": "user", "content": "probe"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "probed", "tool_call_id": "kvshift01", "name": "kvshift_probe"},
    ]
    try:
        rendered = tokenizer.apply_chat_template(probe, tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True)
    except Exception:  # a template's own refusal raises whatever its author chose
        return "kvshift"
    if not isinstance(rendered, str) or "kvshift probe tool" not in rendered:
        return "kvshift"
    return next((layout for written, layout in _PROBE_CALLS.items() if written in rendered), "kvshift")


def _render(
    tokenizer: Any, messages: list[dict[str, Any]], spaced: Callable[[str], bool], tools: Sequence[Any] = ()
) -> str:
    """The prompt text; a template's own refusal (roles that do not alternate…) is the caller's error.

    Without a template, a plain transcript ending in ``"Assistant:"``; a content that does not
    start with a space (``spaced``) gets one, so that a reply the model wrote after the colon
    (``" Paris"``) reads back as the same tokens in the next turn's prompt.
    """
    if not getattr(tokenizer, "chat_template", None):
        lines = [f"{m['role'].capitalize()}:{'' if spaced(m['content']) else ' '}{m['content']}\n" for m in messages]
        return "".join(lines) + "Assistant:"
    try:
        return tokenizer.apply_chat_template(
            messages, tools=list(tools) or None, tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # jinja2's TemplateError, or what the template's raise_exception raises
        raise InvalidInputError(f"the model's chat template refused these messages: {exc}") from exc


def _usable_reply_ids(tokenizer: Any, ids: Sequence[int], content: str) -> bool:
    """Whether a reply's given ids can stand for its content: they read back as it, and hold no
    special token (a caller's ids must not open a turn or a role the template did not write)."""
    if any(i >= len(tokenizer) for i in ids) or set(ids) & set(tokenizer.all_special_ids):
        return False
    return tokenizer.decode(ids) == content


def build_layout(
    tokens: TokenMemo | ScopedTokens,
    messages: list[Message],
    memories: Sequence[str],
    system_prompt: str,
    memory_header: str,
    tools: Sequence[dict[str, Any]] = (),
) -> PromptLayout:
    """Tokenise ``messages`` with ``memories`` placed in the system message, and ``tools``
    (OpenAI-format) as the model's tool layout writes them (:func:`tool_layout`).

    ``messages``, ``memories`` and ``tools`` must already be validated (roles known, contents
    strings, memories stripped and non-empty); a message's own ``"memories"`` are texts here.
    """
    if tokens.tool_layout == "kvshift":
        messages, tools = as_text_turns(messages, tools), ()
    tag = secrets.token_hex(8)
    contents: dict[str, tuple[str, bool, Sequence[int] | None]] = {}  # sentinel -> (text, is memory, ids)

    def sentinel(text: str, is_memory: bool = False, ids: Sequence[int] | None = None) -> str:
        key = f"\x00{tag}:{len(contents)}\x00"
        contents[key] = (text, is_memory, ids)
        return key

    def as_text(value: Any) -> Any:
        """A caller's tool field (a call's name, id and arguments, a tool's schema and description)
        with every string in it that could read as template tokens made a content: tokenised as
        text, as a message's content is, wherever the template writes it (as is, or in JSON).
        Plain words (``"function"``, ``"object"``, a tool's name) stay as they are: templates
        compare them."""
        if isinstance(value, str):
            plain = _PLAIN_FIELD.fullmatch(value) and tokens.encode(value, split_special=False) == tokens.encode(value)
            return value if plain else sentinel(value)
        if isinstance(value, dict):
            return {as_text(key): as_text(item) for key, item in value.items()}
        if isinstance(value, list):
            return [as_text(item) for item in value]
        return value

    header = f"\n\n{memory_header}\n"
    if messages[0]["role"] == "system":
        system_text, rest = messages[0]["content"], messages[1:]
    else:
        system_text, rest = system_prompt, messages
    system_key = sentinel(system_text)
    system = system_key
    if memories:
        system += sentinel(header) + "".join(sentinel(f"{text}\n", True) for text in memories)
    fold = tokens.style == "fold"
    rendered_messages = [] if fold else [{"role": "system", "content": system}]
    if fold and (not rest or rest[0]["role"] != "user"):
        rest = [{"role": "user", "content": ""}, *rest]  # the system message needs a user turn to open
    memory_texts = list(memories)
    for message in rest:
        content = message["content"]
        if message.get("memories"):
            memory_texts.extend(message["memories"])
            offsets = message.get("memories_at")
            if offsets is None:
                placed = "".join(sentinel(f"{text}\n", True) for text in message["memories"])
                content = sentinel(f"{memory_header}\n") + placed + sentinel(f"\n{content}")
            else:  # where the caller's text had them, introduced by the caller's own words
                pieces, done = [], 0
                for text, at in zip(message["memories"], offsets, strict=True):
                    pieces += [sentinel(content[done:at]), sentinel(f"{text}\n", True)]
                    done = at
                content = "".join(pieces) + sentinel(content[done:])
        elif message.get("tool_calls"):
            content = sentinel(content) if content else ""  # a template writes no text before a bare call
        else:
            reply_ids: Sequence[int] | None = message.get("token_ids")
            if reply_ids is None and message["role"] == "assistant":
                reply_ids = tokens.reply_ids(content)  # what the model wrote, when this engine wrote it
            if reply_ids is not None and not _usable_reply_ids(tokens.tokenizer, reply_ids, content):
                reply_ids = None  # tokenise the text instead
            content = sentinel(content, ids=reply_ids)
        if fold and not rendered_messages:
            content = system + sentinel("\n\n") + content
        rendered: dict[str, Any] = {"role": message["role"], "content": content}
        if message.get("tool_calls"):
            rendered["tool_calls"] = [
                {
                    "id": as_text(call.get("id") or f"call{number}"),
                    "type": "function",
                    "function": {"name": as_text(call["name"]), "arguments": as_text(call["arguments"])},
                }
                for number, call in enumerate(message["tool_calls"])
            ]
        rendered |= {key: as_text(message[key]) for key in ("tool_call_id", "name") if key in message}
        rendered_messages.append(rendered)

    def spaced(content: str) -> bool:
        first = contents.get(content[: content.index("\x00", 1) + 1] if content else "")
        return first is not None and first[0][:1].isspace()

    text = _render(tokens.tokenizer, rendered_messages, spaced, as_text(list(tools)))

    def as_json(quoted: re.Match[str]) -> str:
        found = contents.get(f"\x00{quoted[1]}\x00")
        return quoted[0] if found is None or found[1] else sentinel(json.dumps(found[0], ensure_ascii=False))

    # a template that writes a content as JSON (Llama 3.1 a tool's result): that JSON, in our tokens
    text = re.sub(rf'"\\u0000({tag}:\d+)\\u0000"', as_json, text)

    ids: list[int] = []
    spans: list[FragmentSpan] = []
    system_end = 0
    next_memory = iter(memory_texts)
    for piece in text.split("\x00"):
        key = f"\x00{piece}\x00"
        if key in contents:
            content, is_memory, given = contents[key]
            piece_ids: Sequence[int] = given if given is not None else tokens.encode(content)
            if is_memory:
                spans.append(FragmentSpan(len(ids), len(ids) + len(piece_ids), next(next_memory), tuple(piece_ids)))
        elif piece:
            piece_ids = tokens.encode(piece, split_special=False)
        else:
            continue
        ids.extend(piece_ids)
        if key == system_key:
            system_end = len(ids)
    conditioning = ids[:system_end] + list(tokens.encode(header))
    return PromptLayout(
        torch.tensor(ids, dtype=torch.long, device="cpu"),
        tuple(spans),
        torch.tensor(conditioning, dtype=torch.long, device="cpu"),
    )
