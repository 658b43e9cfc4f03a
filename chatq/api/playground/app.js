// The chatq playground: plain JS against the API's own routes. Streams are read with fetch rather than EventSource,
// which cannot send an Authorization header.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "chatq.apiKey";
const state = { history: [], controller: null, jobId: null, opened: new Map() };

class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

function notice(text) {
  $("notice").textContent = text || "";
}

async function api(path, options = {}) {
  const headers = { "Content-Type": "application/json", ...(options.headers || {}) };
  const key = localStorage.getItem(KEY);
  if (key) headers.Authorization = `Bearer ${key}`;
  const resp = await fetch(path, { ...options, headers });
  if (resp.ok) return resp;
  const body = await resp.json().catch(() => ({}));
  if (resp.status === 401) {
    // Keys are configured: the page learns it here, and shows the field for one.
    $("key-field").hidden = false;
    throw new ApiError(key ? "The API key was refused: check it above." : "This API needs an API key: enter it above.", 401);
  }
  throw new ApiError((body.error && body.error.message) || `HTTP ${resp.status}`, resp.status);
}

// Server-Sent Events from a fetch response: {id, data} per event; comments (keep-alives) are skipped.
async function* events(resp) {
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let id = null;
      const data = [];
      for (const line of frame.split("\n")) {
        if (line.startsWith("id:")) id = Number(line.slice(3));
        else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
      }
      if (data.length) yield { id, data: data.join("\n") };
    }
  }
}

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

// One answer as it streams in: its reasoning (collapsible), its text, its tool calls and how it ended.
function answerView() {
  const root = element("div", "msg assistant");
  const reasoning = element("details", "reasoning");
  reasoning.append(element("summary", "", "reasoning"), element("div", "reasoning-text"));
  reasoning.hidden = true;
  const content = element("div", "content");
  const calls = element("div", "tool-calls");
  const end = element("div", "finish");
  root.append(reasoning, content, calls, end);
  return { root, reasoning, content, calls, end, text: "", tools: [] };
}

function apply(view, chunk) {
  if (chunk.error) {
    view.end.replaceChildren(element("span", "error", chunk.error.message));
    return;
  }
  for (const choice of chunk.choices || []) {
    if (choice.index !== 0) continue; // the playground shows the first choice
    const delta = choice.delta || { content: choice.text }; // legacy text completions carry `text`
    const reasoning = delta.reasoning_content || delta.reasoning;
    if (reasoning) {
      view.reasoning.hidden = false;
      view.reasoning.lastChild.textContent += reasoning;
    }
    if (delta.content) {
      view.text += delta.content;
      view.content.textContent = view.text;
    }
    for (const call of delta.tool_calls || []) addToolCall(view, call);
    if (choice.finish_reason) view.end.textContent = `finished: ${choice.finish_reason}`;
  }
}

function addToolCall(view, call) {
  let tool = view.tools[call.index];
  if (!tool) {
    tool = view.tools[call.index] = { name: "", args: "", el: element("div", "tool-call") };
    view.calls.append(tool.el);
  }
  if (call.function && call.function.name) tool.name = call.function.name;
  if (call.function && call.function.arguments) tool.args += call.function.arguments;
  tool.el.textContent = `tool call: ${tool.name}(${tool.args})`;
}

function requestBody(text) {
  const extra = $("extra").value.trim();
  let fields = {};
  if (extra) fields = JSON.parse(extra); // a SyntaxError is shown as the notice
  const messages = [...state.history, { role: "user", content: text }];
  const body = { model: $("model").value, messages, ...fields };
  const maxTokens = Number($("max-tokens").value);
  if (maxTokens > 0 && !("max_tokens" in fields)) body.max_tokens = maxTokens;
  return body;
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  notice("");
  try {
    const body = requestBody(text);
    if ($("background").checked) {
      const resp = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify({ ...body, background: true }) });
      const job = await resp.json();
      notice(`Job ${job.id} is ${job.status}: see the jobs.`);
      $("prompt").value = "";
      refreshJobs();
      return;
    }
    await chat(body, text);
  } catch (e) {
    notice(e.message);
  }
}

async function chat(body, text) {
  const log = $("log");
  log.append(element("div", "msg user", text));
  $("prompt").value = "";
  const view = answerView();
  log.append(view.root);
  state.controller = new AbortController();
  setRunning(true);
  try {
    const resp = await api("/v1/chat/completions", {
      method: "POST",
      body: JSON.stringify({ ...body, stream: true }),
      signal: state.controller.signal,
    });
    for await (const { data } of events(resp)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      state.jobId = chunk.id || state.jobId;
      view.root.dataset.job = state.jobId;
      apply(view, chunk);
      log.scrollTop = log.scrollHeight;
    }
    state.history.push({ role: "user", content: text }, { role: "assistant", content: view.text });
  } catch (e) {
    if (e.name === "AbortError") view.end.textContent = "stopped";
    else view.end.replaceChildren(element("span", "error", e.message));
    if (e instanceof ApiError) notice(e.message);
  } finally {
    state.controller = null;
    state.jobId = null;
    setRunning(false);
    refreshJobs();
  }
}

function setRunning(running) {
  $("send").disabled = running;
  $("stop").disabled = !running;
}

// Stop: the cancel, so the job shows cancelled at once; dropping the stream would cancel it too.
function stop() {
  const { controller, jobId } = state;
  if (jobId) api(`/v1/chat/completions/${encodeURIComponent(jobId)}/cancel`, { method: "POST" }).catch(() => {});
  if (controller) controller.abort();
}

async function refreshJobs() {
  try {
    const resp = await api("/v1/chat/completions?limit=20&order=desc");
    const list = await resp.json();
    $("job-rows").replaceChildren(...list.data.map(jobRow));
    const batches = await (await api("/v1/batches?limit=20")).json();
    $("batch-rows").replaceChildren(...batches.data.map(batchRow));
    const used = await (await api("/v1/usage?days=7")).json();
    $("key-limits").textContent = limitsText(used.key);
    $("usage-rows").replaceChildren(...used.data.map(usageRow));
  } catch (e) {
    if (e.status !== 401) notice(`Jobs: ${e.message}`);
  }
}

// A batch: its progress as lines answered of all, a bar of it, and what can be done with it now.
function batchRow(batch) {
  const row = element("tr");
  row.dataset.id = batch.id;
  const id = element("td", "id", batch.id);
  id.title = batch.id;
  const counts = batch.request_counts || { total: 0, completed: 0, failed: 0 };
  const done = counts.completed + counts.failed;
  const progress = element("td", "progress", `${done} / ${counts.total}`);
  const bar = element("progress");
  bar.max = counts.total || 1;
  bar.value = done;
  progress.append(bar);
  if (counts.failed) progress.title = `${counts.failed} failed`;
  const actions = element("td");
  if (batch.status === "validating" || batch.status === "in_progress") {
    actions.append(button("cancel", "Cancel", () => cancelBatch(batch.id)));
  }
  if (batch.output_file_id) actions.append(button("output", "Output", () => download(batch.output_file_id)));
  if (batch.error_file_id) actions.append(button("errors", "Errors", () => download(batch.error_file_id)));
  row.append(id, element("td", `status status-${batch.status}`, batch.status), progress, actions);
  return row;
}

// What the key may use, as its admin set it: a managed key's name and limits (a fixed key has none).
function limitsText(key) {
  if (!key) return "This key has no limits.";
  const per = (n, unit) => (n ? `${n.toLocaleString()} ${unit}` : `no ${unit} limit`);
  const parts = [per(key.rpm, "requests/min"), per(key.tpm, "tokens/min"), per(key.in_flight, "in flight")];
  if (key.models.length) parts.push(`models: ${key.models.join(", ")}`);
  if (key.expires_at) parts.push(`expires ${new Date(key.expires_at * 1000).toLocaleString()}`);
  return `Key ${key.name}: ${parts.join("; ")}.`;
}

function usageRow(used) {
  const row = element("tr");
  row.dataset.day = used.date;
  row.dataset.model = used.model;
  row.append(element("td", "", used.date), element("td", "", used.model));
  for (const n of [used.requests, used.input_tokens, used.output_tokens]) row.append(element("td", "n", String(n)));
  return row;
}

function button(className, text, onClick) {
  const b = element("button", className, text);
  b.type = "button";
  b.addEventListener("click", onClick);
  return b;
}

async function cancelBatch(id) {
  try {
    await api(`/v1/batches/${encodeURIComponent(id)}/cancel`, { method: "POST" });
  } catch (e) {
    notice(e.message);
  }
  refreshJobs();
}

// A file's content, saved by the browser: fetched with the key, which a plain link could not send.
async function download(fileId) {
  try {
    const resp = await api(`/v1/files/${encodeURIComponent(fileId)}/content`);
    const link = element("a");
    link.href = URL.createObjectURL(await resp.blob());
    link.download = `${fileId}.jsonl`;
    link.click();
    URL.revokeObjectURL(link.href);
  } catch (e) {
    notice(e.message);
  }
}

function jobRow(job) {
  const row = element("tr");
  row.dataset.id = job.id;
  const open = element("button", "open", "Open");
  open.type = "button";
  open.addEventListener("click", () => openJob(job.id));
  const id = element("td", "id", job.id);
  id.title = job.id;
  const tokens = (job.progress && job.progress.completion_tokens) || 0;
  row.append(id, element("td", "", job.model), element("td", `status status-${job.status}`, job.status));
  row.append(element("td", "", String(tokens)), element("td"));
  row.lastChild.append(open);
  return row;
}

// A job's stream, shown from where this page left it: the events already shown are not asked for again, and a
// stream that breaks is resumed after its last event.
async function openJob(id) {
  let seen = state.opened.get(id);
  if (!seen) state.opened.set(id, (seen = { seq: 0, view: answerView(), streaming: false }));
  $("job-view").hidden = false;
  $("job-title").textContent = id;
  $("job-output").replaceChildren(seen.view.root);
  if (seen.streaming) return;
  seen.streaming = true;
  try {
    for (let attempt = 0; attempt < 5; attempt++) {
      try {
        if (await followJob(id, seen)) return;
      } catch (e) {
        if (e instanceof ApiError) throw e;
      }
      await new Promise((resolve) => setTimeout(resolve, 1000));
    }
  } catch (e) {
    notice(e.message);
  } finally {
    seen.streaming = false;
    refreshJobs();
  }
}

// Reads the job's events after `seen.seq` into its view; whether the stream reached its end.
async function followJob(id, seen) {
  const url = `/v1/chat/completions/${encodeURIComponent(id)}?stream=true&starting_after=${seen.seq}`;
  const resp = await api(url);
  if (resp.status === 204) return true; // every event is shown already
  for await (const { id: seq, data } of events(resp)) {
    if (seq !== null) seen.seq = seq;
    if (data === "[DONE]") return true;
    apply(seen.view, JSON.parse(data));
  }
  return false;
}

async function loadModels() {
  const select = $("model");
  try {
    const resp = await api("/v1/models");
    const models = (await resp.json()).data;
    const chosen = localStorage.getItem("chatq.model");
    select.replaceChildren(...models.map((m) => element("option", "", m.id)));
    if (models.some((m) => m.id === chosen)) select.value = chosen;
    if (!models.length) notice("No model is served now: no worker is alive.");
  } catch (e) {
    notice(e.message);
  }
}

function start() {
  const key = localStorage.getItem(KEY);
  if (key) {
    $("key").value = key;
    $("key-field").hidden = false;
  }
  $("key").addEventListener("change", () => {
    localStorage.setItem(KEY, $("key").value.trim());
    notice("");
    loadModels();
    refreshJobs();
  });
  $("model").addEventListener("change", () => localStorage.setItem("chatq.model", $("model").value));
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) send(e);
  });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", () => {
    state.history = [];
    $("log").replaceChildren();
  });
  $("refresh").addEventListener("click", refreshJobs);
  loadModels();
  refreshJobs();
  setInterval(refreshJobs, 3000);
}

start();
