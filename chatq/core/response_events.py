"""The Responses stream's typed events, made from a response job's events: its log holds chat chunks, as every chat
job's does, so a worker taking the job over replays them the same. The events are a pure function of that log, and
their sequence numbers the same from any API replica."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from chatq.core.job import Event, EventKind
from chatq.core.response_object import call_item, item_status, message_id, message_item, reasoning_id, reasoning_item

TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


@dataclass
class _Open:
    """The output item the stream has open."""

    index: int
    item: dict[str, Any]
    text: str = ""


@dataclass
class ResponseEvents:
    """Turns a response job's events, in order, into the Responses stream's events, numbered from 0."""

    response_id: str
    seq: int = -1
    started: bool = False
    ended: bool = False
    outputs: int = 0
    current: _Open | None = None
    calls: dict[int, _Open] = field(default_factory=dict)  # the chat tool call index -> its item

    def _ev(self, kind: str, **data: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq, **data}

    def opening(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        return [self._ev("response.created", response=response)]

    def feed(self, event: Event, snapshot: dict[str, Any]) -> list[dict[str, Any]]:
        """The events for one of the job's events; `ended` is set at its `done` (then `terminal` follows)."""
        if event.event is EventKind.done:
            self.ended = True
            return self._close(item_status(None))
        if event.event is EventKind.error or not event.data or not event.data.get("choices"):
            return []
        out = [] if self.started else [self._ev("response.in_progress", response=snapshot)]
        self.started = True
        choice = event.data["choices"][0]
        out += self._delta(choice.get("delta") or {})
        if choice.get("finish_reason") is not None:
            out += self._close(item_status(choice["finish_reason"]))
        return out

    def terminal(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        # No cancelled event exists in OpenAI's stream: a cancelled response ends as an incomplete one would.
        return [self._ev(TERMINAL.get(response["status"], "response.incomplete"), response=response)]

    def _delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        if delta.get("reasoning"):
            out += self._text("reasoning", reasoning_id(self.response_id), delta["reasoning"])
        if delta.get("content"):
            out += self._text("message", message_id(self.response_id), delta["content"])
        for call in delta.get("tool_calls") or []:
            out += self._call(call)
        return out

    def _open(self, item: dict[str, Any]) -> tuple[_Open, list[dict[str, Any]]]:
        out = self._close()
        self.current = _Open(self.outputs, item)
        self.outputs += 1
        return self.current, [*out, self._ev("response.output_item.added", output_index=self.current.index, item=item)]

    def _text(self, kind: str, item_id: str, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        cur = self.current
        if cur is None or cur.item["id"] != item_id:
            item = message_item(item_id, "", "in_progress") if kind == "message" else reasoning_item(item_id, "")
            item["content"] = []
            cur, out = self._open(item)
            out.append(self._part("response.content_part.added", cur, ""))
        cur.text += text
        where = {"item_id": item_id, "output_index": cur.index, "content_index": 0}
        if kind == "message":
            return [*out, self._ev("response.output_text.delta", **where, delta=text, logprobs=[])]
        return [*out, self._ev("response.reasoning_text.delta", **where, delta=text)]

    def _part(self, kind: str, cur: _Open, text: str) -> dict[str, Any]:
        if cur.item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        else:
            part = {"type": "reasoning_text", "text": text}
        return self._ev(kind, item_id=cur.item["id"], output_index=cur.index, content_index=0, part=part)

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        fn = call.get("function") or {}
        if call.get("id") is not None:
            opened, out = self._open(call_item(call["id"], fn.get("name") or "", "", "in_progress"))
            self.calls[call["index"]] = opened
        target = self.calls.get(call["index"]) or self.current
        if target is None or not fn.get("arguments"):
            return out
        target.text += fn["arguments"]
        where = {"item_id": target.item["id"], "output_index": target.index}
        return [*out, self._ev("response.function_call_arguments.delta", **where, delta=fn["arguments"])]

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        cur, self.current = self.current, None
        if cur is None:
            return []
        item, where = cur.item, {"item_id": cur.item["id"], "output_index": cur.index}
        if item["type"] == "function_call":
            done = call_item(item["call_id"], item["name"], cur.text)
            closing = [
                self._ev("response.function_call_arguments.done", **where, name=item["name"], arguments=cur.text)
            ]
        elif item["type"] == "message":
            done = message_item(item["id"], cur.text, status)
            closing = [
                self._ev("response.output_text.done", **where, content_index=0, text=cur.text, logprobs=[]),
                self._part("response.content_part.done", cur, cur.text),
            ]
        else:
            done = reasoning_item(item["id"], cur.text)
            closing = [
                self._ev("response.reasoning_text.done", **where, content_index=0, text=cur.text),
                self._part("response.content_part.done", cur, cur.text),
            ]
        return [*closing, self._ev("response.output_item.done", output_index=cur.index, item=done)]
