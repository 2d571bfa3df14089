"""A model's reply read by vLLM's parsers: tool calls under ``tool_choice: "auto"``
(``model.tool_call_parser``) and reasoning (``model.reasoning_parser``).

"auto" lets the model decide whether to call a tool, in its own format; a reasoning model
writes its reasoning before its answer, between markers of its own (``<think>...</think>``).
vLLM keeps a parser per model family for each (``hermes`` for Qwen 2.5/3, ``llama3_json``
for Llama 3.1/3.3, ``mistral``, ``pythonic``, ...; ``qwen3``, ``deepseek_r1``, ...), and
its serving layer composes the two into one ``Parser`` (``vllm.parser``): reasoning
first, then calls in what follows. That is what this module runs, with the names
``vllm serve --enable-auto-tool-choice --tool-call-parser T --reasoning-parser R`` takes,
in the ingress, on the text either engine returns; so vLLM must be installed where an
ingress sets one.

A reply is read whole (:meth:`ReplyParsing.parse`) or delta by delta as it streams
(:meth:`ReplyParsing.stream`): calls go out as vLLM streams them (the call's id and name
in its first chunk, then its arguments), reasoning as ``reasoning``, the rest as
``content``. What a parser does not apply to is left alone: a named or "required"
tool_choice (the reply is held to a schema, ingress.tool_reply reads it), and reasoning
under a request's own structured output (both engines hold the whole reply to the grammar
from its first token, so there is no reasoning in it to split off; vLLM starts the
grammar after the reasoning instead).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

logger = logging.getLogger("ray.serve")


@dataclass(slots=True)
class Parsed:
    """A whole reply read by the parsers."""

    content: Optional[str]
    tool_calls: list[dict] = field(default_factory=list)
    reasoning: Optional[str] = None


class ReplyParser:
    """vLLM's tool-call and/or reasoning parser for this model's tokenizer. Raises
    ValueError naming the known parsers for an unknown name, or vLLM's reason when a
    parser cannot read this tokenizer (``deepseek_r1`` needs ``<think>`` among its
    tokens, ``llama3_json`` ``<|python_tag|>``)."""

    def __init__(self, tokenizer: Any, tool_parser: Optional[str] = None, reasoning_parser: Optional[str] = None):
        names = " and ".join(f"model.{k} {v!r}" for k, v in (("tool_call_parser", tool_parser),
                                                              ("reasoning_parser", reasoning_parser)) if v)
        try:
            from vllm.parser.parser_manager import ParserManager
            from vllm.reasoning import ReasoningParserManager
            from vllm.tool_parsers import ToolParserManager
        except ImportError as e:
            raise ValueError(f"{names} needs vLLM installed in the ingress's environment (its parsers "
                             f"are vLLM's): {e}") from None
        for name, manager, what in ((tool_parser, ToolParserManager, "tool_call_parser"),
                                    (reasoning_parser, ReasoningParserManager, "reasoning_parser")):
            if name is not None and name not in manager.list_registered():
                known = ", ".join(sorted(manager.list_registered()))
                raise ValueError(f"model.{what} {name!r} is not one of vLLM's parsers: {known}")
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser
        self._tokenizer = tokenizer
        # One composed class per combination a request can need: (auto tools, reasoning).
        self._classes: dict[tuple[bool, bool], type] = {}
        for tools in ((False, True) if tool_parser else (False,)):
            for reasoning in ((False, True) if reasoning_parser else (False,)):
                if not (tools or reasoning):
                    continue
                try:
                    # With the tokenizer, vLLM builds the parser once to check it can read
                    # it (validate_parser_tokenizer): a mismatch fails here, at start.
                    cls = ParserManager.get_parser(
                        tool_parser_name=tool_parser if tools else None,
                        reasoning_parser_name=reasoning_parser if reasoning else None,
                        enable_auto_tools=tools,
                        model_name=getattr(tokenizer, "name_or_path", None),
                        tokenizer=tokenizer,
                    )
                except Exception as e:  # noqa: BLE001 - vLLM's reason, as a config error
                    raise ValueError(f"{names} cannot read this model's tokenizer: {e}") from None
                self._classes[(tools, reasoning)] = cls

    def for_request(self, req) -> Optional["ReplyParsing"]:
        """How this chat request's reply is read, or None when no parser applies to it."""
        if req.tool_call_mode() is not None:
            return None
        tools = self.tool_parser is not None and req.auto_tool_choice()
        reasoning = self.reasoning_parser is not None and req.structured_output() is None
        if not (tools or reasoning):
            return None
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        body: dict = {
            "model": "-",
            "messages": [{"role": "user", "content": ""}],
            "include_reasoning": req.include_reasoning,
        }
        if tools:
            body.update(tools=req.tools, tool_choice="auto")
            if req.parallel_tool_calls is not None:
                body["parallel_tool_calls"] = req.parallel_tool_calls
        if req.chat_template_kwargs:
            body["chat_template_kwargs"] = req.chat_template_kwargs
        request = ChatCompletionRequest.model_validate(body)
        cls = self._classes[(tools, reasoning)]
        parsing = ReplyParsing(cls, self._tokenizer, request, tools, reasoning)
        first = parsing._new()
        parsing.request = first.adjust_request(request)
        # The instance that adjusted the request reads the (first) reply: a reasoning
        # parser takes ~0.3 ms to build here (qwen3's), twice per request otherwise.
        parsing._spare = first
        return parsing


class ReplyParsing:
    """One request's reading: vLLM's request form, what applies, the prompt's ids."""

    def __init__(self, cls: type, tokenizer: Any, request: Any, tools: bool, reasoning: bool):
        self._cls, self._tokenizer, self.request = cls, tokenizer, request
        self.tools, self.reasoning = tools, reasoning
        # The prompt's token ids: a reasoning parser reads whether it leaves reasoning
        # open (a template that ends its prompt with <think>). Set by the ingress.
        self.prompt_ids: Optional[list[int]] = None
        self._spare = None  # an unused instance, for the first reading
        # An instance that only counts: it reads each reply whole, so the count does not
        # depend on how a stream's deltas were cut (a streaming parser's own count did:
        # one token less when the worker coalesced them otherwise).
        self._counter = None

    @property
    def skip_special_tokens(self) -> bool:
        """Whether the reply's text may leave special tokens out: a parser whose format is
        made of them (``<tool_call>`` in Qwen's vocabulary) sets it off in adjust_request."""
        return bool(getattr(self.request, "skip_special_tokens", True))

    def _new(self):
        if self._spare is not None:
            spare, self._spare = self._spare, None
            return spare
        # The template's variables too, as vLLM's server hands them over: a parser may
        # read whether thinking is on (qwen3's enable_thinking).
        kwargs = self.request.chat_template_kwargs
        return self._cls(self._tokenizer, self.request.tools, **({"chat_template_kwargs": kwargs} if kwargs else {}))

    def count_reasoning_tokens(self, token_ids: list[int]) -> int:
        """How many of a reply's generated ids are reasoning, as vLLM's reasoning parser
        counts them (the ids between its start and end markers; 0 for a parser that does
        not count, and without reasoning parsing): what vLLM reports as
        ``completion_tokens_details.reasoning_tokens``."""
        if not self.reasoning or not token_ids:
            return 0
        try:
            if self._counter is None:
                self._counter = self._new()
            return int(self._counter.count_reasoning_tokens(list(token_ids)))
        except Exception:  # noqa: BLE001 - a count must not fail the reply it describes
            logger.warning("vLLM's reasoning parser failed to count a reply's reasoning tokens; "
                           "reported as 0", exc_info=True)
            return 0

    def parse(self, text: str) -> Parsed:
        parser = self._new()
        reasoning, content, calls = parser.parse(text, self.request, enable_auto_tools=self.tools)
        return Parsed(
            content or None,
            [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in calls or ()],
            reasoning if self.request.include_reasoning else None,
        )

    def stream(self) -> "StreamedReply":
        parser = self._new()
        return StreamedReply(parser, self.request, self.prompt_ids)


class StreamedReply:
    """One choice's reply fed delta by delta: each feed gives the reasoning, the content
    and the tool-call deltas (OpenAI's ``delta.tool_calls`` entries) to send now."""

    def __init__(self, parser, request, prompt_ids: Optional[list[int]]):
        self._parser, self._request, self._prompt_ids = parser, request, prompt_ids
        self.text = ""  # the reply so far, as the engine gave it
        self.called = False  # a tool-call delta went out
        self.reasoned = False  # a reasoning delta went out

    def feed(self, text: str, token_ids: list[int], finished: bool) -> tuple[str, str, list[dict]]:
        self.text += text
        # The prompt is read at the first delta (whether it leaves reasoning open); vLLM's
        # parser starts its tool phase only once it has read one.
        message = self._parser.parse_delta(
            text, list(token_ids), self._request, self._prompt_ids or [], finished=finished
        )
        if message is None:
            return "", "", []
        calls = [self._delta(c) for c in (message.tool_calls or ())]
        self.called = self.called or bool(calls)
        self.reasoned = self.reasoned or bool(message.reasoning)
        return message.reasoning or "", message.content or "", calls

    @staticmethod
    def _delta(call) -> dict:
        out: dict = {"index": call.index}
        if call.id:
            out["id"] = call.id
            out["type"] = "function"
        fn = call.function
        if fn is not None:
            out["function"] = {k: v for k, v in (("name", fn.name), ("arguments", fn.arguments)) if v is not None}
        return out
