"""``tool_choice: "auto"``: the model decides whether to call a tool, in its own format, and
one of vLLM's tool-call parsers reads the calls out of its reply.

``model.tool_call_parser`` names the parser, as ``vllm serve --enable-auto-tool-choice
--tool-call-parser NAME`` does (``hermes`` for Qwen 2.5/3 and Hermes, ``llama3_json`` for
Llama 3.1/3.3, ``mistral``, ``pythonic``, ...): vLLM keeps one per model family and
follows each family's format, which is what a server should reuse rather than write again.
The parsers are vLLM's own classes, run in the ingress on the text both engines return
(the torch engine's too), so vLLM must be installed where an ingress sets one.

A reply is parsed whole (:meth:`ToolCallParser.parse`) or chunk by chunk as it streams
(:meth:`ToolCallParser.stream`): a streamed call goes out as vLLM streams it (the call's
id and name in its first chunk, then its arguments), content before a call as content.
A parser that fails on a reply leaves the reply as plain content (a WARNING, and
``llm_tool_call_parses{outcome="failed"}``): never a failed request.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

logger = logging.getLogger(__name__)


def _call_id() -> str:
    # The ids our named and "required" calls carry (OpenAI's form).
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class Parsed:
    """A whole reply read by the parser: its text outside the calls, and the calls."""

    content: Optional[str]
    tool_calls: list[dict] = field(default_factory=list)


class ToolCallParser:
    """vLLM's tool-call parser ``name`` for this model's tokenizer. Raises ValueError naming
    the known parsers for an unknown name, or the parser's own reason when it cannot read
    this tokenizer (``hermes`` needs ``<tool_call>`` among its tokens, for one)."""

    def __init__(self, name: str, tokenizer: Any):
        try:
            from vllm.tool_parsers import ToolParserManager
        except ImportError as e:
            raise ValueError(
                f"model.tool_call_parser {name!r} needs vLLM installed in the ingress's environment "
                f"(its parsers are vLLM's): {e}"
            ) from None
        try:
            self._cls = ToolParserManager.get_tool_parser(name)
        except KeyError:
            known = ", ".join(sorted(ToolParserManager.list_registered()))
            raise ValueError(f"model.tool_call_parser {name!r} is not one of vLLM's parsers: {known}") from None
        self.name = name
        self._tokenizer = tokenizer
        try:
            self._new(None)  # a tokenizer the parser cannot read fails here, at start
        except Exception as e:  # noqa: BLE001 - the parser's own reason, as a config error
            raise ValueError(f"model.tool_call_parser {name!r} cannot read this model's tokenizer: {e}") from None

    def _new(self, request):
        tools = getattr(request, "tools", None)
        return self._cls(self._tokenizer, tools)

    def request(self, tools: list[dict], parallel_tool_calls: Optional[bool]):
        """vLLM's form of the request, which its parsers read (the tools; a few parsers
        also the tool_choice), after the parser's ``adjust_request``."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        body: dict = {
            "model": "-",
            "messages": [{"role": "user", "content": ""}],
            "tools": tools,
            "tool_choice": "auto",
        }
        if parallel_tool_calls is not None:
            body["parallel_tool_calls"] = parallel_tool_calls
        request = ChatCompletionRequest.model_validate(body)
        return self._new(request).adjust_request(request)

    @staticmethod
    def skip_special_tokens(request) -> bool:
        """Whether the reply's text may leave special tokens out: a parser whose format is
        made of them (``<tool_call>`` in Qwen's vocabulary) sets it off in adjust_request."""
        return bool(getattr(request, "skip_special_tokens", True))

    def parse(self, text: str, request) -> Parsed:
        info = self._new(request).extract_tool_calls(text, request)
        if not info.tools_called:
            return Parsed(text)
        calls = [
            {
                "id": c.id or _call_id(),
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in info.tool_calls
        ]
        return Parsed(info.content or None, calls)

    def stream(self, request) -> "StreamedToolCalls":
        return StreamedToolCalls(self._new(request), request)


class StreamedToolCalls:
    """One choice's reply fed delta by delta: each feed gives the content and the
    tool-call deltas (OpenAI's ``delta.tool_calls`` entries) to send now."""

    def __init__(self, parser, request):
        self._parser = parser
        self._request = request
        self._text = ""
        self._ids: list[int] = []
        self.called = False

    def feed(self, text: str, token_ids: list[int]) -> tuple[str, list[dict]]:
        previous_text, previous_ids = self._text, self._ids
        self._text, self._ids = previous_text + text, previous_ids + list(token_ids)
        message = self._parser.extract_tool_calls_streaming(
            previous_text, self._text, text, previous_ids, self._ids, list(token_ids), self._request
        )
        if message is None:
            return "", []
        calls = [self._delta(c) for c in (message.tool_calls or ())]
        self.called = self.called or bool(calls)
        return message.content or "", calls

    def finish(self) -> list[dict]:
        """The last tool-call delta: arguments the parser read but had not streamed yet
        (vLLM's server sends them with the last chunk too)."""
        if not self._parser.prev_tool_call_arr:
            return []
        rest = self._parser.get_remaining_unstreamed_args()
        if not rest:
            return []
        self.called = True
        index = len(self._parser.prev_tool_call_arr) - 1
        return [{"index": index, "function": {"arguments": rest}}]

    @property
    def text(self) -> str:
        return self._text

    @staticmethod
    def _delta(call) -> dict:
        out: dict = {"index": call.index}
        if call.id:
            out["id"] = call.id
            out["type"] = "function"
        fn = call.function
        if fn is not None:
            out["function"] = {
                k: v for k, v in (("name", fn.name), ("arguments", fn.arguments)) if v is not None
            }
        return out
