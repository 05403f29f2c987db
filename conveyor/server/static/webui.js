// conveyor's built-in page: a chat over /v1/chat/completions (SSE) and a live dashboard fed by
// /v1/dashboard/stream (SSE). Plain browser JavaScript, no dependencies, no build step.
// Both streams are read with fetch() rather than EventSource, which cannot send the API key.
// A multi-model server lists several models in /v1/models: a picker chooses the one chatted with and watched.
// A server still loading its model serves the page already: it shows the load's progress until the model is ready.
"use strict";

const KEY_STORAGE = "conveyor.apiKey";
const HISTORY_S = 60;  // the charts' window
const RECONNECT_MS = 1000;
const MODELS_POLL_MS = 3000;  // how often the models' states (loaded, loading 40%, ...) are refreshed
const LOAD_POLL_MS = 500;  // how often /health is asked while the server's model loads

const state = {
  key: localStorage.getItem(KEY_STORAGE) || "",
  model: null,         // the chosen model's id, sent as `model` in chat requests
  models: [],          // the cards of /v1/models, as last fetched
  modelsPoll: 0,       // the running /v1/models poll's number: a new one (after a key is given) ends the old
  dashboardPath: undefined,  // the stream the dashboard reads; null: none (the chosen model is not loaded)
  messages: [],        // the conversation sent with every request
  images: [],          // data URLs of the images attached to the next message
  chat: null,          // AbortController of the reply being streamed
  dashboard: null,     // AbortController of the dashboard stream
  history: [],         // [{t, tok_s, ttft_s}] for the charts
};

const $ = (id) => document.getElementById(id);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

class Unauthorized extends Error {}

function headers(extra = {}) {
  return state.key ? { ...extra, Authorization: `Bearer ${state.key}` } : extra;
}

// Yields the `data:` payload of each server-sent event of a fetch() response.
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (data) yield data;
    }
  }
}

async function api(path, init = {}) {
  const response = await fetch(path, { ...init, headers: headers(init.headers) });
  if (response.status === 401) throw new Unauthorized();
  if (!response.ok) {
    let message = `HTTP ${response.status}`;
    try { message = (await response.json()).error.message || message; } catch (_) { /* not JSON */ }
    throw new Error(message);
  }
  return response;
}

// -- API key ---------------------------------------------------------------------------------
function askForKey(message) {
  $("key-form").hidden = false;
  $("show-key").hidden = true;
  $("key-error").textContent = message || "";
  setConn("locked", "API key needed");
  $("api-key").focus();
}

function useKey(event) {
  event.preventDefault();
  state.key = $("api-key").value.trim();
  localStorage.setItem(KEY_STORAGE, state.key);
  $("key-form").hidden = true;
  $("show-key").hidden = false;
  connect();
}

// -- chat ------------------------------------------------------------------------------------
function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function addMessage(role, text, images = []) {
  const node = el("div", `msg ${role}`);
  if (images.length) node.append(imageStrip(images, "images"));
  node.append(el("div", "content", text));
  $("chat-log").append(node);
  node.scrollIntoView({ block: "end" });
  return node;
}

// One assistant reply as it streams: reasoning folded, content, tool calls, a meta line.
class Reply {
  constructor(model) {
    this.model = model;  // shown in the meta line when the page offers a choice of models
    this.node = addMessage("assistant", "");
    this.node.dataset.state = "streaming";
    this.reasoning = "";
    this.content = "";
    this.toolCalls = [];
    this.started = performance.now();
    this.firstToken = null;
    this.tokens = 0;
  }

  add(delta) {
    if (this.firstToken === null) this.firstToken = performance.now();
    if (delta.reasoning_content) this.reasoning += delta.reasoning_content;
    if (delta.content) this.content += delta.content;
    for (const call of delta.tool_calls || []) {
      const slot = this.toolCalls[call.index] ||= { id: call.id, name: "", arguments: "" };
      if (call.function?.name) slot.name += call.function.name;
      if (call.function?.arguments) slot.arguments += call.function.arguments;
    }
    this.render();
  }

  // Updates the reply in place, so a reasoning block the user unfolded stays open while it streams.
  render() {
    if (!this.parts) {
      const details = el("details", "reasoning");
      details.hidden = true;
      details.append(el("summary", "", "Reasoning"), el("pre"));
      this.parts = { details, content: el("div", "content"), tools: el("div", "tools") };
      this.node.replaceChildren(details, this.parts.content, this.parts.tools);
    }
    const { details, content, tools } = this.parts;
    details.hidden = !this.reasoning;
    details.querySelector("pre").textContent = this.reasoning;
    content.textContent = this.content;
    tools.replaceChildren(...this.toolCalls.filter(Boolean).map(
      (call) => el("div", "tool", `tool call: ${call.name}(${call.arguments})`)));
    this.node.scrollIntoView({ block: "end" });
  }

  finish(outcome, usage) {
    this.node.dataset.state = outcome === "error" ? "error" : outcome === "stopped" ? "stopped" : "done";
    const parts = this.model ? [outcome, this.model] : [outcome];
    if (usage) {
      parts.push(`${usage.completion_tokens} tokens`);
      const seconds = (performance.now() - (this.firstToken ?? this.started)) / 1000;
      if (usage.completion_tokens > 1 && seconds > 0) parts.push(`${((usage.completion_tokens - 1) / seconds).toFixed(1)} tok/s`);
    }
    if (this.firstToken !== null) parts.push(`first token ${((this.firstToken - this.started) / 1000).toFixed(2)} s`);
    this.node.append(el("div", "meta", parts.join(" · ")));
  }

  fail(message) {
    this.node.append(el("div", "meta", `error: ${message}`));
    this.node.dataset.state = "error";
  }

  message() {
    const message = { role: "assistant", content: this.content };
    const calls = this.toolCalls.filter(Boolean);
    if (calls.length) {
      message.tool_calls = calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } }));
    }
    return message;
  }
}

function numberField(id) {
  const text = $(id).value.trim();
  return text === "" ? undefined : Number(text);
}

function requestBody() {
  const system = $("system").value.trim();
  const body = {
    model: state.model || undefined,
    messages: system ? [{ role: "system", content: system }, ...state.messages] : state.messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberField("temperature"),
    top_p: numberField("top_p"),
    max_tokens: numberField("max_tokens"),
    seed: numberField("seed"),
    ignore_eos: $("ignore_eos").checked || undefined,  // a server extension (llama-server's too)
  };
  const tools = $("tools").value.trim();
  if (tools) body.tools = JSON.parse(tools);  // a SyntaxError is shown as the reply's error
  return body;
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  const images = state.images;
  if ((!text && !images.length) || state.chat) return;
  $("prompt").value = "";
  state.images = [];
  renderAttachments();
  // With images, chat's content parts: the images (data URLs) first, then the text, as in OpenAI's examples.
  const content = images.length
    ? [...images.map((url) => ({ type: "image_url", image_url: { url } })), ...(text ? [{ type: "text", text }] : [])]
    : text;
  state.messages.push({ role: "user", content });
  addMessage("user", text, images);
  const reply = new Reply(hasPicker() ? state.model : null);
  const controller = new AbortController();
  state.chat = controller;
  setBusy(true);
  let finish = null, usage = null, refused = false;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody()), signal: controller.signal,
    }).catch((error) => { refused = error.name !== "AbortError"; throw error; });
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      if (choice.delta) reply.add(choice.delta);
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    reply.finish(finish ? `finished: ${finish}` : "ended", usage);
  } catch (error) {
    if (error.name === "AbortError") reply.finish("stopped", null);
    else if (error instanceof Unauthorized) { reply.fail("unauthorized"); askForKey("The server wants an API key."); }
    else reply.fail(error.message);
  } finally {
    state.chat = null;
    setBusy(false);
  }
  if (hasPicker()) refreshModels();  // the reply may have loaded its model: show it, and watch it
  // A refused message (a 400: an image the model cannot take...) leaves the conversation, so the next one is not
  // refused for it again; it stays on the page with the error.
  if (refused) state.messages.pop();
  else state.messages.push(reply.message());
}

// -- images: picked or pasted, sent as data URLs (the server decodes and checks them) ---------------------------
function imageStrip(urls, className, onClick) {
  const strip = el("div", className);
  urls.forEach((url, i) => {
    const img = el("img", "thumb");
    img.src = url;
    img.alt = `image ${i + 1}`;
    if (onClick) { img.title = "click to remove"; img.addEventListener("click", () => onClick(i)); }
    strip.append(img);
  });
  return strip;
}

function renderAttachments() {
  const strip = imageStrip(state.images, "", (i) => { state.images.splice(i, 1); renderAttachments(); });
  $("attachments").replaceChildren(...strip.childNodes);
}

function attachFiles(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    const reader = new FileReader();
    reader.addEventListener("load", () => { state.images.push(reader.result); renderAttachments(); });
    reader.readAsDataURL(file);
  }
}

function pasteImages(event) {
  const files = [...(event.clipboardData?.files || [])].filter((f) => f.type.startsWith("image/"));
  if (!files.length) return;  // text pastes as text
  event.preventDefault();
  attachFiles(files);
}

// Aborting the fetch closes the connection; the server aborts the request and frees its KV blocks.
function stop() {
  if (state.chat) state.chat.abort();
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// -- dashboard -------------------------------------------------------------------------------
function setConn(name, text) {
  $("conn").dataset.state = name;
  $("conn").textContent = text || name;
}

async function runDashboard(path) {
  if (state.dashboard) state.dashboard.abort();
  const controller = new AbortController();
  state.dashboard = controller;
  while (!controller.signal.aborted) {
    try {
      const response = await api(path, { signal: controller.signal });
      setConn("live");
      for await (const data of sseData(response)) render(JSON.parse(data));
    } catch (error) {
      if (controller.signal.aborted) return;
      if (error instanceof Unauthorized) { askForKey(state.key ? "That key was refused." : ""); return; }
    }
    setConn("reconnecting");
    await sleep(RECONNECT_MS);
    // Its model may have been unloaded: reopening the stream would load it again, so the list decides.
    if (state.models.some((card) => card.status)) await refreshModels();
  }
}

function stopDashboard(card) {
  if (state.dashboard) state.dashboard.abort();
  state.dashboard = null;
  setConn("waiting", card ? `${card.id}: ${modelState(card)}` : "no model");
}

function render(snapshot) {
  $("dashboard").classList.remove("stale");
  document.body.dataset.role = snapshot.role;
  $("model").textContent = snapshot.model;
  state.history.push({ t: snapshot.time, tokens: snapshot.counters.generated_tokens,
                       tok_s: smoothedRate(snapshot), ttft_s: snapshot.rates.ttft_s });
  while (state.history.length && state.history[0].t < snapshot.time - HISTORY_S) state.history.shift();
  if (snapshot.role === "router") renderRouter(snapshot);
  else renderNode(snapshot);
  drawChart($("chart-toks"), state.history.map((h) => [h.t, h.tok_s]), snapshot.time);
  drawChart($("chart-ttft"), state.history.map((h) => [h.t, h.ttft_s]), snapshot.time);
}

// tokens/s over the last RATE_WINDOW_S from the cumulative counter (a 0.25 s difference is jumpy).
const RATE_WINDOW_S = 1;
function smoothedRate(snapshot) {
  const tokens = snapshot.counters.generated_tokens;
  if (tokens === null || tokens === undefined) return null;
  const then = state.history.findLast((h) => h.t <= snapshot.time - RATE_WINDOW_S && h.tokens !== null);
  if (!then || tokens < then.tokens) return snapshot.rates.tok_s;  // too young, or the server restarted
  return (tokens - then.tokens) / (snapshot.time - then.t);
}

const percent = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)} %`);
const fixed = (x, digits) => (x === null || x === undefined ? "–" : x.toFixed(digits));

function lastValue(key) {
  for (let i = state.history.length - 1; i >= 0; i--) if (state.history[i][key] !== null) return state.history[i][key];
  return null;
}

function renderNode(s) {
  const k = s.kernels;
  $("backend").textContent = `${k.backend}${k.arch ? ` (${k.arch})` : ""}`;
  const formats = Object.keys(s.weights.formats);
  $("weights").textContent = `weights ${s.weights.weight_dtype}${formats.length ? `: ${formats.join(", ")}` : ""}`;
  $("stat-running").textContent = `${s.num_running} / ${s.slots_total}`;
  $("stat-queue").textContent = `${s.queue_depth}`;
  $("stat-prefix").textContent = percent(s.prefix_cache.enabled ? s.prefix_cache.hit_rate : null);
  $("stat-spec").textContent = s.speculation.acceptance === null ? "–" : percent(s.speculation.acceptance);
  $("stat-toks").textContent = fixed(lastValue("tok_s"), 1);
  const ttft = lastValue("ttft_s");
  $("stat-ttft").textContent = ttft === null ? "–" : `${ttft.toFixed(3)} s`;
  const kv = s.kv;
  const share = (n) => `${kv.total ? (100 * n) / kv.total : 0}%`;
  const bar = $("kv-bar");
  bar.querySelector(".used").style.width = share(kv.used);
  bar.querySelector(".cached").style.width = share(kv.cached_free);
  bar.querySelector(".free").style.width = share(kv.free);
  $("kv-text").textContent = `${kv.used} used · ${kv.cached_free} cached · ${kv.free} free of ${kv.total} (${kv.block_size} tokens each)`;
  bar.dataset.used = kv.used;
  // Hybrid models: each running sequence also holds a fixed-size recurrent-state slot.
  $("state-line").hidden = !s.state;
  if (s.state) {
    const mib = (b) => (b / 2 ** 20).toFixed(1);
    $("state-text").textContent = `${s.state.live} live · ${s.state.snapshots} snapshots · ${s.state.free} free of ` +
      `${s.state.slots} slots (${mib(s.state.bytes_per_slot)} MiB each, ${s.state.snapshot_hits} snapshot hits)`;
  }
  renderTiers(s.tiers);
  renderSlots(s);
}

// The prefix cache's two tiers: cached blocks in RAM, and block files on disk (--prompt-cache-dir).
function renderTiers(tiers) {
  if (!tiers) return;
  const mib = (b) => (b / 2 ** 20).toFixed(1);
  const budget = (b) => (b === null || b === undefined ? "no cap" : `${mib(b)} MiB budget`);
  const ram = tiers.ram;
  $("tier-ram-text").textContent = `${ram.entries} blocks · ${mib(ram.bytes)} MiB (${budget(ram.budget_bytes)}) · ` +
    `${ram.hit_tokens} hit tokens · ${ram.evictions} evicted`;
  const disk = tiers.disk;
  $("tier-disk").hidden = !disk;
  if (disk) {
    $("tier-disk-text").textContent = `${disk.entries} blocks · ${mib(disk.bytes)} MiB (${budget(disk.budget_bytes)}) · ` +
      `${disk.hits} hits (${disk.preloaded ?? 0} preloaded) · ${disk.writes} writes · ${disk.dropped} dropped · ${disk.rejected} rejected · ` +
      `${disk.corrupt} corrupt`;
  }
}

function renderSlots(s) {
  const rows = s.requests.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.state = r.state;
    const prefill = r.state === "prefilling" || r.state === "pooling";  // pooling: an embedding's or a score's
    if (prefill || r.state === "decoding") tr.className = "active";
    const progress = el("td");
    if (prefill) {
      const bar = el("progress");
      bar.max = r.prompt_tokens;
      bar.value = r.computed_tokens;
      progress.append(bar, ` ${r.computed_tokens}/${r.prompt_tokens}`);
    } else if (r.state === "decoding") {
      progress.textContent = `${r.output_tokens}/${r.max_tokens}`;
    } else {
      progress.textContent = r.preemptions ? `preempted ${r.preemptions}×` : "waiting";
    }
    tr.append(el("td", "id", r.id), el("td", "state", r.state), progress,
              el("td", "", `${r.prompt_tokens} + ${r.output_tokens}`), el("td", "", fixed(r.tok_s, 1)));
    return tr;
  });
  const idle = s.slots_total - s.num_running;
  if (idle > 0) {
    const tr = document.createElement("tr");
    tr.dataset.state = "idle";
    const td = el("td", "", `${idle} idle slot${idle === 1 ? "" : "s"}`);
    td.colSpan = 5;
    tr.append(td);
    rows.splice(s.num_running, 0, tr);
  }
  $("slots").tBodies[0].replaceChildren(...rows);
}

function renderRouter(s) {
  $("backend").textContent = "router";
  $("weights").textContent = "";
  const rows = s.nodes.map((n) => {
    const tr = document.createElement("tr");
    tr.dataset.state = n.status;
    tr.append(el("td", "", n.role), el("td", "id", n.address), el("td", "state", n.status),
              el("td", "", `${n.dispatched}`), el("td", "", `${n.in_flight}`), el("td", "", `${n.failures}`));
    return tr;
  });
  $("nodes").tBodies[0].replaceChildren(...rows);
  const r = s.routing;
  $("router-text").textContent = `${r.requests} routed (${r.forwarded} embeddings, rerank, score) · ` +
    `${r.completed} completed · ${r.failed} failed · ${r.cancelled} cancelled · ` +
    `${s.awaiting_first_token} awaiting a first token`;
}

// A line over the last HISTORY_S seconds; gaps (no value) break the line.
function drawChart(canvas, points, now) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  if (!width || !height) return;
  canvas.width = width * ratio;
  canvas.height = height * ratio;
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  ctx.clearRect(0, 0, width, height);
  const values = points.map((p) => p[1]).filter((v) => v !== null);
  const top = Math.max(...values, 0) * 1.15 || 1;
  const x = (t) => width - ((now - t) / HISTORY_S) * width;
  const y = (v) => height - 14 - (v / top) * (height - 20);
  ctx.strokeStyle = "#deded8";
  ctx.beginPath(); ctx.moveTo(0, y(0)); ctx.lineTo(width, y(0)); ctx.stroke();
  ctx.strokeStyle = "#2f6fdb";
  ctx.lineWidth = 1.5;
  ctx.fillStyle = "#2f6fdb";
  ctx.beginPath();
  let drawing = false;
  for (const [t, v] of points) {
    if (v === null) { drawing = false; continue; }
    if (drawing) ctx.lineTo(x(t), y(v)); else ctx.moveTo(x(t), y(v));
    drawing = true;
    ctx.fillRect(x(t) - 1.5, y(v) - 1.5, 3, 3);  // a lone value (a TTFT between gaps) still shows
  }
  ctx.stroke();
  ctx.fillStyle = "#6b6b70";
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillText(`max ${values.length ? Math.max(...values).toPrecision(3) : "–"}`, 2, height - 2);
}

// -- models ----------------------------------------------------------------------------------
// A multi-model server's cards carry `status` (unloaded, loading, loaded, unloading, failed);
// a single model's card has none and is always served.
const chosenCard = () => state.models.find((card) => card.id === state.model);
const hasPicker = () => state.models.length > 1;

function modelState(card) {
  const status = card.status;
  if (status.value === "loading" && status.progress) return `loading ${Math.round(100 * status.progress.fraction)}%`;
  return status.value + (status.pinned ? ", pinned" : "");
}

// The poll stops on a 401 (the key form restarts it through connect()).
async function pollModels() {
  const poll = ++state.modelsPoll;
  while (poll === state.modelsPoll && await refreshModels()) await sleep(MODELS_POLL_MS);
}

// false when the server wants a key; an unreachable list keeps the last one (none: the dashboard as ever).
async function refreshModels() {
  try {
    const models = await (await api("/v1/models")).json();
    showModels(models.data || []);
  } catch (error) {
    if (error instanceof Unauthorized) { askForKey(state.key ? "That key was refused." : ""); return false; }
    followModel();
  }
  return true;
}

function showModels(cards) {
  state.models = cards;
  // Keep the choice while it is served; else a loaded model (watching it loads nothing), else the first.
  if (!chosenCard()) state.model = (cards.find((card) => card.status?.value === "loaded") ?? cards[0])?.id ?? null;
  if (state.model) $("model").textContent = state.model;
  renderPicker();
  followModel();
}

// Options are relabelled in place while the list stays the same, so an open drop-down stays open.
function renderPicker() {
  const select = $("model-select");
  $("model-picker").hidden = !hasPicker();
  const ids = state.models.map((card) => card.id);
  const shown = [...select.options].map((option) => option.value);
  if (shown.length !== ids.length || shown.some((id, i) => id !== ids[i])) {
    select.replaceChildren(...ids.map((id) => Object.assign(el("option"), { value: id })));
  }
  state.models.forEach((card, i) => {
    select.options[i].textContent = card.status ? `${card.id} — ${modelState(card)}` : card.id;
    select.options[i].title = card.status?.error || "";
  });
  select.value = state.model ?? "";
}

function pickModel() {
  state.model = $("model-select").value;
  $("model").textContent = state.model;
  followModel();
}

// The dashboard watches the chosen model only while it is loaded: its stream would load it, and an open
// stream holds its model, so it is closed once the model starts to unload.
function dashboardPath() {
  const card = chosenCard();
  if (!card?.status) return "/v1/dashboard/stream";  // one model (or no list): the server's own
  return card.status.value === "loaded" ? `/v1/dashboard/stream?model=${encodeURIComponent(card.id)}` : null;
}

function followModel() {
  const path = dashboardPath();
  if (path === state.dashboardPath) {
    if (path === null) stopDashboard(chosenCard());  // its state may have moved on (loading 40%)
    return;
  }
  if (state.dashboardPath !== undefined) {  // another model's: its charts and figures are not this one's
    state.history = [];
    $("dashboard").classList.add("stale");  // until the first snapshot of the new stream
  }
  state.dashboardPath = path;
  if (path === null) stopDashboard(chosenCard());
  else runDashboard(path);
}

// -- the model's load ------------------------------------------------------------------------
// `conveyor serve` listens before its model is loaded (server/deferred.py): every API route answers 503
// "loading" meanwhile, and /health the load's progress, shown by the loading panel until the model is ready.

// Asked of /v1/models, which the page reads first anyway, not /health: /health is a 503 on servers that are
// up too (a router missing a node, a draining server), and the browser logs every failed fetch as an error.
async function modelIsLoading() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    return response.status === 503 && (await response.json()).error?.code === "loading";
  } catch (_) {
    return false;  // unreachable, or not JSON: the page starts as ever and shows what it can
  }
}

async function readHealth() {
  try {
    return await (await fetch("/health", { cache: "no-store" })).json();
  } catch (_) {
    return null;  // unreachable, or not JSON
  }
}

// true once /health no longer says "loading"; false when the server went away meanwhile, as it does when
// its model fails to load.
async function waitForLoad() {
  for (;;) {
    const health = await readHealth();
    if (health === null) { showGone(); return false; }
    if (health.status !== "loading") break;
    showLoadPanel(true);
    if (health.progress) renderLoad(health.progress);  // none: the app is up, its engine not yet
    await sleep(LOAD_POLL_MS);
  }
  showLoadPanel(false);
  setConn("connecting");  // as the page starts; the dashboard's stream says what comes next
  return true;
}

function showLoadPanel(shown) {
  $("loading").hidden = !shown;
  document.querySelector("main").hidden = shown;
}

function renderLoad(progress) {
  setConn("loading", "loading the model");
  $("load-stage").textContent = `stage: ${progress.stage ?? "starting"}`;
  const download = progress.download || {};
  renderLoadBar("download", download.bytes, download.bytes_total, "");
  renderLoadBar("weights", progress.bytes, progress.bytes_total,
                ` · ${progress.tensors}/${progress.tensors_total} tensors`);
  $("load-elapsed").textContent = progress.elapsed_s === undefined ? "" : `${Math.round(progress.elapsed_s)} s elapsed`;
}

// A bar of the panel (download, weights), shown once its total is known.
function renderLoadBar(name, done = 0, total = 0, suffix) {
  $(`load-${name}`).hidden = !total;
  if (!total) return;
  const mb = (bytes) => (bytes / 1e6).toFixed(1);
  const percent = Math.floor((100 * done) / total);
  $(`load-${name}-bar`).value = done / total;
  $(`load-${name}-text`).textContent = `${mb(done)} of ${mb(total)} MB (${percent}%)${suffix}`;
}

function showGone() {
  showLoadPanel(true);
  $("loading").dataset.state = "gone";
  $("load-title").textContent =
    "The server went away before its model was ready (a failed load stops it; its log says why).";
  setConn("gone", "server gone");
}

// -- start -----------------------------------------------------------------------------------
async function start() {
  if (await modelIsLoading() && !(await waitForLoad())) return;  // the server went away
  connect();
}

function connect() {
  state.dashboardPath = undefined;  // the dashboard (re)starts with the first list
  pollModels();
}

document.addEventListener("DOMContentLoaded", () => {
  $("chat-form").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("chat-form").requestSubmit(); }
  });
  $("stop").addEventListener("click", stop);
  $("attach").addEventListener("click", () => $("image-file").click());
  $("image-file").addEventListener("change", (event) => { attachFiles(event.target.files); event.target.value = ""; });
  $("prompt").addEventListener("paste", pasteImages);
  $("clear").addEventListener("click", () => { state.messages = []; $("chat-log").replaceChildren(); });
  $("key-form").addEventListener("submit", useKey);
  $("show-key").addEventListener("click", () => askForKey(""));
  $("model-select").addEventListener("change", pickModel);
  $("api-key").value = state.key;
  start();
});
