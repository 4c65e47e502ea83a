"""The tool-call format: how tools, tool calls and tool results become tokens, and how a model
turn becomes text and tool calls again.

Two formats, chosen by `chat_format(tokenizer)`:

- `TemplateFormat`: the model's own chat template (`tokenizer.apply_chat_template(...,
  tools=...)`), where it has one that knows tools. The opening prompt is the template's; the
  environment's tokens after a model turn are what the template writes between the end of that
  turn and the opening of the next assistant turn (tool results, user turns). The model's own
  tokens are never re-encoded: the stream is exactly what was generated. Calls are parsed in the
  template's syntax: `<tool_call>{json}</tool_call>` (Qwen, Hermes and most others),
  `[TOOL_CALLS][{json}, ...]` (Mistral), or a bare JSON object `{"name": ..., "parameters": ...}`
  (Llama 3.x, optionally after `<|python_tag|>`). A template without tool support still gives
  the roles; the tools are then described in a system message and tool results come back as
  user turns in `<tool_response>` tags (folded into the next user turn, and consecutive turns
  of one role joined, for a template that refuses a system role or two user turns in a row,
  like Gemma's).
- `FallbackFormat`: for tokenizers without a chat template (the demo's character model). Plain
  text, documented here and in docs/concepts/environments.md:

      {system}\\n                                  (each system message)
      Tools: {tool spec as JSON}\\n               (one line per tool; `describe_tools`)
      {user}\\n                                    (each user message)
      {text}<tool_call>{"name": N, "arguments": {...}}</tool_call><eos>   (the model's turn)
      <tool_response>{result}</tool_response>\\n  (each tool result)

  A tool with exactly one parameter may also be called compactly, `<tool_call>N ARG</tool_call>`
  (ARG is the parameter's value, as written): short turns for a small model.

How much of each tool the opening shows is `describe_tools`, in both formats: true (`"full"`,
the default) the whole spec, JSON schema and all; `"brief"` the name, the first line of the
description and each argument's name and type (a template renders that instead of the full
spec: a small context stays free for the episode); false (`"none"`) no tool lines in the
fallback format, and for a model's own template the brief form still (its template needs
tools to teach its call syntax at all).

Parsing never raises on what the model wrote: bad JSON, an unknown tool, a missing required
argument or an unclosed tag becomes an entry of `ModelTurn.errors`, which the runner sends back
to the model as a tool message (`error: ...`) so it can try again.
"""

from __future__ import annotations

import hashlib
import json
import string
from typing import Any

from rlboost.envs.protocol import Message, ModelTurn, ToolCall, ToolSpec, idempotency_key


# ---------------------------------------------------------------- parsing


def _arguments(value: Any) -> dict[str, Any] | str:
    """A call's arguments as a dict, or an error message."""
    if value is None:
        return {}
    if isinstance(value, str):  # some models write the arguments as a JSON string
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError as e:
            return f"arguments are not valid JSON ({e})"
    if not isinstance(value, dict):
        return f"arguments must be a JSON object, got {type(value).__name__}"
    return value


def _check_call(name: Any, args: Any, tools: dict[str, ToolSpec]) -> tuple[str, dict[str, Any]] | str:
    if not isinstance(name, str) or not name:
        return "a tool call needs a \"name\""
    if tools and name not in tools:
        return f"unknown tool {name!r} (tools: {', '.join(sorted(tools))})"
    parsed = _arguments(args)
    if isinstance(parsed, str):
        return f"{name}: {parsed}"
    spec = tools.get(name)
    required = (spec.parameters.get("required") or []) if spec else []
    missing = [r for r in required if r not in parsed]
    if missing:
        return f"{name}: missing argument {', '.join(repr(m) for m in missing)}"
    return name, parsed


def _single_param(spec: ToolSpec | None) -> str | None:
    props = (spec.parameters.get("properties") or {}) if spec else {}
    return next(iter(props)) if len(props) == 1 else None


def _json_call(body: str, tools: dict[str, ToolSpec], compact: bool) -> tuple[str, dict[str, Any]] | str:
    """One call from a JSON object `{"name": ..., "arguments"|"parameters": {...}}`, or (compact)
    `name ARG` for a tool of one parameter."""
    body = body.strip()
    try:
        obj = json.loads(body)
    except ValueError as e:
        if compact and body and not body.startswith(("{", "[")):
            name, _, rest = body.partition(" ")
            param = _single_param(tools.get(name))
            if name in tools and (param is not None or not rest.strip()):
                return _check_call(name, {param: rest.strip()} if param else {}, tools)
        return f"invalid JSON in a tool call ({e.msg} at char {e.pos})" if isinstance(e, json.JSONDecodeError) \
            else f"invalid JSON in a tool call ({e})"
    if not isinstance(obj, dict):
        return f"a tool call must be a JSON object, got {type(obj).__name__}"
    if "function" in obj and isinstance(obj["function"], dict):  # the OpenAI shape
        obj = obj["function"]
    return _check_call(obj.get("name"), obj.get("arguments", obj.get("parameters")), tools)


class Syntax:
    """How a model writes tool calls; `parse(text)` -> (text outside calls, calls, errors), each
    call `(name, arguments)` or, where the model wrote one, `(name, arguments, call id)`."""

    name = "hermes"

    def __init__(self, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>", compact: bool = True) -> None:
        self.open_tag, self.close_tag, self.compact = open_tag, close_tag, compact

    def parse(self, text: str, tools: dict[str, ToolSpec]) -> tuple[str, list[tuple[str, dict]], list[str]]:
        calls: list[tuple[str, dict]] = []
        errors: list[str] = []
        outside: list[str] = []
        pos = 0
        while True:
            start = text.find(self.open_tag, pos)
            if start < 0:
                outside.append(text[pos:])
                break
            outside.append(text[pos:start])
            end = text.find(self.close_tag, start + len(self.open_tag))
            if end < 0:
                errors.append(f"unclosed {self.open_tag}: end each call with {self.close_tag}")
                break
            got = _json_call(text[start + len(self.open_tag):end], tools, self.compact)
            (errors if isinstance(got, str) else calls).append(got)
            pos = end + len(self.close_tag)
        return "".join(outside).strip(), calls, errors

    def write(self, name: str, arguments: dict[str, Any], spec: ToolSpec | None = None, compact: bool = False) -> str:
        param = _single_param(spec)
        if compact and param is not None and set(arguments) == {param} and isinstance(arguments[param], str):
            body = f"{name} {arguments[param]}"
        else:
            body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{self.open_tag}{body}{self.close_tag}"


class MistralSyntax(Syntax):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` or `[TOOL_CALLS]name[ARGS]{...}`."""

    name = "mistral"
    TAG = "[TOOL_CALLS]"

    def __init__(self) -> None:
        super().__init__(self.TAG, "", compact=False)

    def parse(self, text: str, tools: dict[str, ToolSpec]) -> tuple[str, list[tuple[str, dict]], list[str]]:
        head, tag, rest = text.partition(self.TAG)
        if not tag:
            return text.strip(), [], []
        calls: list[tuple[str, dict]] = []
        errors: list[str] = []
        for chunk in rest.split(self.TAG):
            chunk = chunk.strip()
            if "[ARGS]" in chunk:
                name, _, args = chunk.partition("[ARGS]")
                got = _check_call(name.strip(), args, tools)
                (errors if isinstance(got, str) else calls).append(got)
                continue
            try:
                obj = json.loads(chunk)
            except ValueError as e:
                errors.append(f"invalid JSON after {self.TAG} ({e})")
                continue
            for item in obj if isinstance(obj, list) else [obj]:
                got = _json_call(json.dumps(item), tools, False)
                if not isinstance(got, str) and isinstance(item, dict) and isinstance(item.get("id"), str):
                    got = (*got, item["id"])  # the model's own call id: the template quotes it in the result
                (errors if isinstance(got, str) else calls).append(got)
        return head.strip(), calls, errors

    def write(self, name: str, arguments: dict[str, Any], spec: ToolSpec | None = None, compact: bool = False) -> str:
        return f"{self.TAG}{json.dumps([{'name': name, 'arguments': arguments}])}"


class JsonSyntax(Syntax):
    """Llama 3.x: the whole turn is one JSON object `{"name": ..., "parameters": {...}}`
    (optionally after `<|python_tag|>`); a turn that is not JSON is plain text."""

    name = "json"
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__("", "", compact=False)

    def parse(self, text: str, tools: dict[str, ToolSpec]) -> tuple[str, list[tuple[str, dict]], list[str]]:
        body = text.replace(self.TAG, "").strip()
        tagged = self.TAG in text
        if not (tagged or (body.startswith("{") and body.endswith("}"))):
            return text.strip(), [], []
        calls: list[tuple[str, dict]] = []
        errors: list[str] = []
        for part in [p for p in body.split(";") if p.strip()] if tagged else [body]:
            got = _json_call(part, tools, False)
            (errors if isinstance(got, str) else calls).append(got)
        return "", calls, errors

    def write(self, name: str, arguments: dict[str, Any], spec: ToolSpec | None = None, compact: bool = False) -> str:
        return json.dumps({"name": name, "parameters": arguments})


def syntax_for_template(template: str) -> Syntax:
    if "[TOOL_CALLS]" in template:
        return MistralSyntax()
    if "<tool_call>" in template:
        return Syntax(compact=False)
    if "<|python_tag|>" in template or '"parameters"' in template:
        return JsonSyntax()
    return Syntax(compact=False)


def parse_turn(text: str, syntax: Syntax, tools: list[ToolSpec], episode_id: str, turn: int,
               finish_reason: str = "stop") -> ModelTurn:
    """A decoded model turn as text and tool calls (each with its idempotency key). Never raises."""
    by_name = {t.name: t for t in tools}
    try:
        outside, calls, errors = syntax.parse(text, by_name)
    except Exception as e:  # a parser bug must not end a worker: the model reads it as an error
        outside, calls, errors = text, [], [f"the tool call could not be read ({type(e).__name__})"]
    return ModelTurn(text=outside, raw=text, finish_reason=finish_reason, errors=errors,
                     tool_calls=[ToolCall(key=idempotency_key(episode_id, turn, i), name=c[0], arguments=c[1], index=i,
                                          id=c[2] if len(c) > 2 else "")
                                 for i, c in enumerate(calls)])


# ---------------------------------------------------------------- how much of a tool the opening shows


DESCRIBE = {True: "full", "full": "full", "brief": "brief", False: "none", "none": "none"}


def describe_mode(value: Any) -> str:
    """`describe_tools` as one of full | brief | none (ValueError for anything else)."""
    try:
        return DESCRIBE[value]
    except (KeyError, TypeError):
        raise ValueError(f"describe_tools: {value!r} must be true, false, \"full\", \"brief\" or \"none\"") from None


def brief_tool(spec: ToolSpec) -> ToolSpec:
    """`spec` shortened for a small context: the first line of its description and each
    argument's name and type (and which are required); no descriptions, enums or bounds."""
    params = spec.parameters or {}
    props = {name: ({"type": p["type"]} if isinstance(p, dict) and "type" in p else {})
             for name, p in (params.get("properties") or {}).items()}
    brief: dict[str, Any] = {"type": "object", "properties": props}
    if params.get("required"):
        brief["required"] = list(params["required"])
    first = spec.description.strip().splitlines()[0].strip() if spec.description.strip() else ""
    return ToolSpec(name=spec.name, description=first, parameters=brief)


def described(tools: list[ToolSpec], mode: str) -> list[ToolSpec]:
    return list(tools) if mode == "full" else [brief_tool(t) for t in tools] if mode == "brief" else []


# ---------------------------------------------------------------- formats


class ChatFormat:
    """Turns messages into token ids and model tokens into a `ModelTurn`."""

    syntax: Syntax
    stop_ids: list[int]

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    @property
    def turn_end_id(self) -> int:
        """The token that ends an assistant turn in this format (for writing whole conversations)."""
        return self.stop_ids[0]

    def encode(self, text: str, special: bool = False) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def decode_turn(self, token_ids: list[int]) -> str:
        """The text of a model turn: special tokens kept (some templates' tool tags are special
        tokens), the stop tokens removed."""
        ids = [t for t in token_ids if t not in self.stop_ids]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        pad = getattr(self.tokenizer, "pad_token", None)
        return text.replace(pad, "") if pad else text

    def parse(self, token_ids: list[int], tools: list[ToolSpec], episode_id: str, turn: int,
              finish_reason: str = "stop") -> ModelTurn:
        return parse_turn(self.decode_turn(token_ids), self.syntax, tools, episode_id, turn, finish_reason)

    def prompt_ids(self, messages: list[Message], tools: list[ToolSpec]) -> list[int]:
        """The opening: `messages` and the tools, ready for the model's first turn."""
        raise NotImplementedError

    def env_ids(self, transcript: list[Message], new: list[Message], tools: list[ToolSpec],
                turn_end_id: int | None = None) -> list[int]:
        """The tokens after a model turn (the last assistant message of `transcript`, which
        ended with the stop token `turn_end_id`): the messages `new`, then the opening of the
        next assistant turn."""
        raise NotImplementedError

    def assistant_text(self, message: Message, tools: list[ToolSpec]) -> str:
        """How the model writes `message` (without the stop token): for a warm start."""
        by_name = {t.name: t for t in tools}
        calls = "".join(self.syntax.write(c.name, c.arguments, by_name.get(c.name), compact=self.compact_calls)
                        for c in message.tool_calls)
        return message.content + calls

    compact_calls = False

    def conversation_ids(self, messages: list[Message], tools: list[ToolSpec]) -> tuple[list[int], list[int]]:
        """A whole conversation as the runner would have recorded it, and a mask that is 1 on
        the assistant's tokens: supervised warm-start data in the episode's own format."""
        first = next((i for i, m in enumerate(messages) if m.role == "assistant"), len(messages))
        ids = self.prompt_ids(messages[:first], tools)
        mask = [0] * len(ids)
        i = first
        while i < len(messages):
            m = messages[i]
            turn = self.encode(self.assistant_text(m, tools)) + [self.turn_end_id]
            ids += turn
            mask += [1] * len(turn)
            j = i + 1
            while j < len(messages) and messages[j].role != "assistant":
                j += 1
            if j > i + 1 or j < len(messages):
                env = self.env_ids(messages[:i + 1], messages[i + 1:j], tools, self.turn_end_id)
                ids += env
                mask += [0] * len(env)
            i = j
        return ids, mask


class FallbackFormat(ChatFormat):
    """Plain text for tokenizers without a chat template (the layout is in the module doc)."""

    name = "fallback"

    def __init__(self, tokenizer, describe_tools: bool | str = True, compact_calls: bool = False,
                 result_open: str = "<tool_response>", result_close: str = "</tool_response>") -> None:
        super().__init__(tokenizer)
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("the fallback chat format needs a tokenizer with an EOS token (the end of a model turn)")
        self.stop_ids = [eos]
        self.syntax = Syntax(compact=True)
        self.describe_tools, self.compact_calls = describe_mode(describe_tools), compact_calls
        self.result_open, self.result_close = result_open, result_close

    def render(self, m: Message, tools: list[ToolSpec]) -> str:
        if m.role == "tool":
            return f"{self.result_open}{m.content}{self.result_close}\n"
        if m.role == "assistant":
            return self.assistant_text(m, tools) + (self.tokenizer.eos_token or "")
        return f"{m.content}\n"

    def prompt_ids(self, messages: list[Message], tools: list[ToolSpec]) -> list[int]:
        systems = [m for m in messages if m.role == "system"]
        rest = [m for m in messages if m.role != "system"]
        text = "".join(self.render(m, tools) for m in systems)
        text += "".join(f"Tools: {json.dumps(t.openai()['function'], ensure_ascii=False)}\n"
                        for t in described(tools, self.describe_tools))
        text += "".join(self.render(m, tools) for m in rest)
        return self.encode(text, special=True)

    def env_ids(self, transcript: list[Message], new: list[Message], tools: list[ToolSpec],
                turn_end_id: int | None = None) -> list[int]:
        return self.encode("".join(self.render(m, tools) for m in new))


class TemplateFormat(ChatFormat):
    """The model's own chat template (see the module doc)."""

    name = "template"
    END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

    def __init__(self, tokenizer, describe_tools: bool | str = True) -> None:
        super().__init__(tokenizer)
        # false keeps the brief form: a template shown no tools teaches no call syntax either
        mode = describe_mode(describe_tools)
        self.describe_tools = "brief" if mode == "none" else mode
        template = tokenizer.chat_template
        if isinstance(template, dict):  # several named templates: the one for tools, else the default
            template = template.get("tool_use") or template.get("default") or next(iter(template.values()))
        self.template = template or ""
        self.tools_native = "tools" in self.template
        self.syntax = syntax_for_template(self.template) if self.tools_native else Syntax(compact=False)
        vocab = tokenizer.get_vocab()
        stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        stops += [vocab[m] for m in self.END_MARKERS if m in vocab and vocab[m] not in stops]
        if not stops:
            raise ValueError("the chat template's tokenizer has no end-of-turn token")
        self.stop_ids = stops
        # call ids as the template wants them: Mistral's templates refuse any but 9 characters
        self.short_ids = self.syntax.name == "mistral"
        # a template that refuses a system role or two user turns in a row (Gemma's): ours (the
        # tools' description, tool results as user turns) are folded into the user turns
        self.fold = False
        if not self.tools_native:
            try:
                self._render([Message(role="system", content="s"), Message(role="user", content="u"),
                              Message(role="user", content="v")], [], generation=True)
            except Exception:
                self.fold = True

    @property
    def turn_end_id(self) -> int:
        """The stop token the template writes after an assistant message (`<|im_end|>` where
        the tokenizer's EOS is `<|endoftext|>`)."""
        try:
            text = self._render([Message(role="user", content="."), Message(role="assistant", content="x")], [],
                                generation=False)
        except Exception:
            return self.stop_ids[0]
        tail = text[text.rfind("x") + 1:]
        found = [(tail.find(s), i) for i, s in zip(self.stop_ids, self.tokenizer.convert_ids_to_tokens(self.stop_ids))
                 if s and s in tail]
        return min(found)[1] if found else self.stop_ids[0]

    def _chat(self, messages: list[Message], tools: list[ToolSpec]) -> tuple[list[dict], list[dict] | None]:
        tools = described(tools, self.describe_tools)
        if self.tools_native:
            chat = [m.chat() for m in messages]
            if self.short_ids:  # the id the model wrote, else one of 9 characters from the key
                ids: dict[str, str] = {}
                for m, d in zip(messages, chat, strict=True):
                    for c, cd in zip(m.tool_calls, d.get("tool_calls", ()), strict=True):
                        cd["id"] = ids[c.key] = c.id if len(c.id) == 9 and c.id.isalnum() else call_id(c.key)
                    if m.role == "tool":  # an error answering a call the parser refused has no key
                        d["tool_call_id"] = ids.get(m.tool_call_id) or call_id(m.tool_call_id or m.content)
            return chat, [t.openai() for t in tools] or None
        out: list[dict] = []
        if tools:  # the template cannot show tools: describe them in a system message of our own
            lines = "\n".join(json.dumps(t.openai()["function"], ensure_ascii=False) for t in tools)
            out.append({"role": "system", "content": "You may call these tools, one per <tool_call>"
                        "{\"name\": ..., \"arguments\": {...}}</tool_call>:\n" + lines})
        for m in messages:
            if m.role == "tool":
                out.append({"role": "user", "content": f"<tool_response>{m.content}</tool_response>"})
            elif m.role == "assistant":
                out.append({"role": "assistant", "content": self.assistant_text(m, tools)})
            elif m.role == "system" and out and out[0]["role"] == "system" and len(out) == 1:
                out[0]["content"] = m.content + "\n\n" + out[0]["content"]
            else:
                out.append({"role": m.role, "content": m.content})
        return (_folded(out) if self.fold else out), None

    def _render(self, messages: list[Message], tools: list[ToolSpec], generation: bool) -> str:
        chat, tool_dicts = self._chat(messages, tools)
        kwargs: dict[str, Any] = {"tools": tool_dicts} if tool_dicts else {}
        # the template this format read, always: a tokenizer with named templates would pick
        # its `default` (no tools) for a call without tools, another template than the prompt's
        return self.tokenizer.apply_chat_template(chat, add_generation_prompt=generation, tokenize=False,
                                                  chat_template=self.template, **kwargs)

    def prompt_ids(self, messages: list[Message], tools: list[ToolSpec]) -> list[int]:
        return self.encode(self._render(messages, tools, generation=True))

    def env_ids(self, transcript: list[Message], new: list[Message], tools: list[ToolSpec],
                turn_end_id: int | None = None) -> list[int]:
        end = self.tokenizer.convert_ids_to_tokens(turn_end_id if turn_end_id is not None else self.stop_ids[0])
        # the real history first; a template that rewrites history when messages are added
        # (dropping earlier reasoning) gets a short one: the last assistant turn alone
        last = next((i for i in range(len(transcript) - 1, -1, -1) if transcript[i].role == "assistant"), None)
        histories = [(transcript, tools)]
        if last is not None:
            short = [Message(role="user", content="."), transcript[last]]
            # then without tools: a template that moves them with the last user turn (Mistral's
            # [AVAILABLE_TOOLS]) rewrites history when the environment adds a user turn; then
            # the turn as text: a template that refuses the turn's calls (Llama 3.1: one a turn)
            histories += [(short, tools), (short, []),
                          ([short[0], Message(role="assistant", content=transcript[last].content or ".")], [])]
        for history, shown in histories:
            try:
                before = self._render(history, shown, generation=False)
                after = self._render(history + new, shown, generation=True)
            except Exception:
                continue
            cut = before.rfind(end)
            if not after.startswith(before) or cut < 0:
                continue
            return self.encode(before[cut + len(end):] + after[len(before):])
        raise ValueError(f"the chat template does not extend the conversation after {end!r}: "
                         "cannot tell the environment's tokens apart")

    def assistant_text(self, message: Message, tools: list[ToolSpec]) -> str:
        if not self.tools_native or not message.tool_calls:
            return super().assistant_text(message, tools)
        # what the template writes for this turn, between the generation prompt and the stop token
        history = [Message(role="user", content=".")]
        try:
            before = self._render(history, tools, generation=True)
            after = self._render(history + [message], tools, generation=False)
        except Exception:
            return super().assistant_text(message, tools)
        body = after[len(before):] if after.startswith(before) else ""
        stops = [s for s in self.tokenizer.convert_ids_to_tokens(self.stop_ids) if s and s in body]
        if not stops:
            return super().assistant_text(message, tools)
        return body[:min(body.find(s) for s in stops)]


def call_id(key: str) -> str:
    """A call's idempotency key as 9 letters and digits (a digest: the same key, the same id),
    for templates that take no other call id."""
    digest = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    alphabet = string.ascii_letters + string.digits
    out = ""
    for _ in range(9):
        digest, r = divmod(digest, len(alphabet))
        out += alphabet[r]
    return out


def _folded(chat: list[dict]) -> list[dict]:
    """`chat` for a template that refuses a system role and two turns of one role in a row:
    each system message opens the next user turn, and consecutive turns of one role are one."""
    out: list[dict] = []
    carry: list[str] = []
    for m in chat:
        if m["role"] == "system":
            carry.append(m["content"])
            continue
        content = "\n\n".join(carry + [m["content"]]) if m["role"] == "user" else m["content"]
        if m["role"] == "user":
            carry = []
        if out and out[-1]["role"] == m["role"]:
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + content}
        else:
            out.append({**m, "content": content})
    if carry:  # system text with no user turn after it: a user turn of its own
        if out and out[-1]["role"] == "user":
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + "\n\n".join(carry)}
        else:
            out.append({"role": "user", "content": "\n\n".join(carry)})
    return out


def chat_format(tokenizer, describe_tools: bool | str = True, **fallback_options: Any) -> ChatFormat:
    """The model's own chat template where it has one, else the documented fallback.
    `describe_tools` (both formats): how much of each tool the opening shows (module doc)."""
    if getattr(tokenizer, "chat_template", None):
        return TemplateFormat(tokenizer, describe_tools=describe_tools)
    return FallbackFormat(tokenizer, describe_tools=describe_tools, **fallback_options)
