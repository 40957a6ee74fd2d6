// pagestream chat page: one WebSocket to /v1/ws, one generation at a time.
//
// The protocol (see service/ws.py): we send `generate` {id, messages, params, truncation} and
// `cancel` {id}; the server answers with `delta` {id, text, token_ids, reasoning?}
// frames, then one `done` {id, finish_reason, usage} (finish_reason "abort" after a cancel) or an `error`.
// With resumable streams each of those frames has a `seq` and deltas a `resume` token:
// when the socket drops mid-reply, the next socket sends `resume` {id, resume, after}
// and the reply goes on where it stopped (the server keeps generating meanwhile).
// Model output is untrusted text: it only ever reaches the DOM through text nodes.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const els = {
    status: $("status"),
    model: $("model"),
    system: $("system-prompt"),
    maxTokens: $("max-tokens"),
    temperature: $("temperature"),
    topP: $("top-p"),
    seed: $("seed"),
    ignoreEos: $("ignore-eos"),
    apiKey: $("api-key"),
    conversation: $("conversation"),
    empty: $("empty"),
    composer: $("composer"),
    input: $("input"),
    send: $("send"),
    stop: $("stop"),
    newChat: $("new-chat"),
  };

  const SETTINGS_KEY = "pagestream.settings";
  const API_KEY_KEY = "pagestream.apiKey";
  // Settings that persist across reloads (the API key is stored on its own).
  const PERSISTED = ["system", "maxTokens", "temperature", "topP", "seed", "ignoreEos"];
  const RETRY_MIN_MS = 500;
  const RETRY_MAX_MS = 10000;
  // How long a reply waits for a new socket to resume it; the server gives up on it after
  // its --resume-grace (5 s by default) anyway, and a late resume is refused.
  const RESUME_WINDOW_MS = 10000;

  let ws = null; // the live socket, or null while (re)connecting
  let retryDelay = 0; // grows while the server stays unreachable
  let retryTimer = null;
  let connectedOnce = false; // since load or the last API key change
  let history = []; // turns sent with every generate: {role, content, el}
  let current = null; // the running generation, or null
  let counter = 0;

  // ------------------------------------------------------------------ storage
  // localStorage throws in some privacy modes; the page must still work without it.
  function storageGet(key) {
    try {
      return localStorage.getItem(key);
    } catch {
      return null;
    }
  }

  function storageSet(key, value) {
    try {
      if (value === null || value === "") localStorage.removeItem(key);
      else localStorage.setItem(key, value);
    } catch {
      /* not persisted; harmless */
    }
  }

  function loadSettings() {
    els.apiKey.value = storageGet(API_KEY_KEY) || "";
    let saved = {};
    try {
      saved = JSON.parse(storageGet(SETTINGS_KEY) || "{}") || {};
    } catch {
      saved = {};
    }
    for (const name of PERSISTED) {
      if (!(name in saved)) continue;
      if (els[name].type === "checkbox") els[name].checked = !!saved[name];
      else els[name].value = String(saved[name]);
    }
  }

  function saveSettings() {
    const out = {};
    for (const name of PERSISTED) {
      out[name] = els[name].type === "checkbox" ? els[name].checked : els[name].value;
    }
    storageSet(SETTINGS_KEY, JSON.stringify(out));
  }

  // ------------------------------------------------------------------ connection
  function setStatus(state, text) {
    els.status.dataset.state = state;
    els.status.textContent = text;
  }

  function isOpen() {
    return ws !== null && ws.readyState === WebSocket.OPEN;
  }

  function socketUrl() {
    // Relative to the page, so the page works behind a proxy that serves it under a path
    // prefix (https://example.com/llm/ reaches the server's /).
    const url = new URL("v1/ws", location.href);
    url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
    const key = els.apiKey.value.trim();
    // Browsers cannot set headers on a WebSocket, so the key travels in the query.
    if (key) url.searchParams.set("api_key", key);
    return url.href;
  }

  function connect() {
    clearTimeout(retryTimer);
    retryTimer = null;
    setStatus("connecting", "connecting…");
    const sock = new WebSocket(socketUrl());
    ws = sock;
    // Every handler checks `ws === sock`: a socket we replaced on purpose (API key change)
    // may still fire events, and those must not touch the new connection's state.
    sock.onopen = () => {
      if (ws !== sock) return;
      connectedOnce = true;
      retryDelay = 0;
      setStatus("open", "connected");
      if (current && current.resuming) {
        current.resuming = false;
        clearTimeout(current.resumeTimer);
        const { id, resume, seq } = current;
        sock.send(JSON.stringify({ type: "resume", id, resume, after: seq }));
      }
      updateButtons();
      loadModelName();
    };
    sock.onmessage = (ev) => {
      if (ws === sock) onFrame(ev.data);
    };
    sock.onclose = (ev) => {
      if (ws !== sock) return;
      ws = null;
      const why = "connection lost; the reply was not completed";
      // 1006: the connection died without a close frame (a network blip), so the server
      // may still be generating it.  Any close the server sent (going away, too slow,
      // engine failure) ended the reply there.
      if (ev.code === 1006) suspendCurrent(why);
      else if (current) failCurrent(why);
      scheduleReconnect();
      updateButtons();
    };
  }

  function scheduleReconnect() {
    // Exponential backoff with jitter, so many pages do not reconnect in lockstep after a
    // server restart.  Never having connected is often a wrong API key (the server answers
    // the upgrade with 401, which a browser cannot read), hence the hint.
    retryDelay = Math.min(RETRY_MAX_MS, Math.max(RETRY_MIN_MS, retryDelay * 2));
    const wait = Math.round(retryDelay * (0.8 + 0.4 * Math.random()));
    const why = connectedOnce
      ? "disconnected"
      : "cannot connect (server down or wrong API key?)";
    setStatus("closed", `${why}; retrying in ${(wait / 1000).toFixed(1)} s`);
    retryTimer = setTimeout(connect, wait);
  }

  function reconnectNow() {
    const old = ws;
    ws = null; // detach first so the old socket's close event is ignored
    if (current && !current.resuming) {
      // Given up here, so stop it there too: a closed socket's generations would run on
      // for the server's resume grace period.
      if (old && old.readyState === WebSocket.OPEN) {
        old.send(JSON.stringify({ type: "cancel", id: current.id }));
      }
      failCurrent("connection closed to reconnect; the reply was not completed");
    }
    if (old) old.close();
    retryDelay = 0;
    connect();
    updateButtons();
  }

  function suspendCurrent(why) {
    // A reply the server can resume (it sent a token) waits for the next socket, for a
    // while; the server aborts any other when its socket closes, so say so in the bubble.
    const gen = current;
    if (gen === null) return;
    if (!gen.resume) {
      failCurrent(why);
      return;
    }
    gen.resuming = true;
    clearTimeout(gen.resumeTimer);
    gen.resumeTimer = setTimeout(() => {
      if (current === gen && gen.resuming) failCurrent(why);
    }, RESUME_WINDOW_MS);
  }

  async function loadModelName() {
    // Purely informative: show what the server is serving.
    const key = els.apiKey.value.trim();
    try {
      const resp = await fetch("v1/models", {
        headers: key ? { Authorization: `Bearer ${key}` } : {},
      });
      if (!resp.ok) return;
      const body = await resp.json();
      if (body.data && body.data.length) els.model.textContent = body.data[0].id;
    } catch {
      /* the status indicator already covers connectivity */
    }
  }

  // ------------------------------------------------------------------ rendering
  function nearBottom() {
    const c = els.conversation;
    return c.scrollHeight - c.scrollTop - c.clientHeight < 40;
  }

  function scrollIfFollowing(wasNearBottom) {
    // Follow the stream only if the reader has not scrolled up to read something.
    if (wasNearBottom) els.conversation.scrollTop = els.conversation.scrollHeight;
  }

  function bubble(role, text) {
    const follow = nearBottom();
    els.empty.hidden = true;
    const el = document.createElement("div");
    el.className = `msg ${role}`;
    el.dataset.role = role;
    const body = document.createElement("div");
    body.className = "text";
    body.textContent = text;
    el.appendChild(body);
    els.conversation.appendChild(el);
    scrollIfFollowing(follow);
    return el;
  }

  function notice(text) {
    const el = bubble("notice", text);
    el.setAttribute("role", "alert");
    return el;
  }

  function addLine(el, cls, text) {
    const line = document.createElement("div");
    line.className = cls;
    line.textContent = text;
    el.appendChild(line);
    return line;
  }

  function updateButtons() {
    els.send.disabled = !isOpen() || current !== null;
    els.stop.disabled = current === null || current.cancelling || !isOpen();
  }

  // ------------------------------------------------------------------ generation
  function readParams() {
    const params = {};
    const maxTokens = parseInt(els.maxTokens.value, 10);
    if (Number.isFinite(maxTokens)) params.max_tokens = maxTokens; // else: fill the context
    const temperature = parseFloat(els.temperature.value);
    if (Number.isFinite(temperature)) params.temperature = temperature;
    const topP = parseFloat(els.topP.value);
    if (Number.isFinite(topP) && topP !== 1) params.top_p = topP;
    const seed = parseInt(els.seed.value, 10);
    if (Number.isFinite(seed)) params.seed = seed;
    if (els.ignoreEos.checked) params.ignore_eos = true;
    // Out-of-range values go to the server as typed: its 400 names the field inline.
    return params;
  }

  function send() {
    const text = els.input.value;
    if (!text.trim() || current !== null || !isOpen()) return;

    const userTurn = { role: "user", content: text, el: bubble("user", text) };
    history.push(userTurn);
    const el = bubble("assistant", "");
    el.classList.add("streaming");
    const body = el.querySelector(".text");
    const textNode = document.createTextNode("");
    body.appendChild(textNode);

    const messages = [];
    // An empty system prompt means none, rather than an empty system turn.
    if (els.system.value.trim()) messages.push({ role: "system", content: els.system.value });
    for (const turn of history) messages.push({ role: turn.role, content: turn.content });

    counter += 1;
    current = {
      id: `g${counter}-${Date.now().toString(36)}`,
      userTurn,
      el,
      textNode,
      text: "",
      thinking: null, // the thinking fold's text node, once reasoning arrived
      tokens: 0,
      tSent: performance.now(),
      tFirst: null,
      tLast: null,
      cancelling: false,
      resume: null, // the server's resume token, once a delta brought it
      seq: 0, // the last frame of this generation shown
      resuming: false,
      resumeTimer: null,
    };
    // truncation "auto": a chat longer than the model's window loses its oldest turns on
    // the server (the system prompt kept) instead of failing (docs/CONVERSATIONS.md).
    ws.send(JSON.stringify({
      type: "generate", id: current.id, messages, params: readParams(), truncation: "auto",
    }));
    els.input.value = "";
    updateButtons();
  }

  function stop() {
    if (current === null || current.cancelling || !isOpen()) return;
    current.cancelling = true;
    ws.send(JSON.stringify({ type: "cancel", id: current.id }));
    // The bubble finishes when the server's `done` (finish_reason "abort") arrives.
    updateButtons();
  }

  function newChat() {
    if (current !== null && isOpen()) {
      // Frames that still arrive for it are ignored: their id is no longer current.
      ws.send(JSON.stringify({ type: "cancel", id: current.id }));
    }
    current = null;
    history = [];
    for (const el of [...els.conversation.querySelectorAll(".msg")]) el.remove();
    els.empty.hidden = false;
    updateButtons();
    els.input.focus();
  }

  function onDelta(f) {
    if (current === null || f.id !== current.id) return;
    if (f.resume) current.resume = f.resume;
    if (f.index !== 0) return;
    const follow = nearBottom();
    const now = performance.now();
    const n = (f.token_ids || []).length;
    if (current.tFirst === null && (n || f.text)) current.tFirst = now;
    current.tLast = now;
    current.tokens += n;
    if (f.reasoning) thinking(current).appendData(f.reasoning);
    if (f.text) {
      if (current.thinking) current.thinking.parentNode.parentNode.open = false; // answered
      current.text += f.text;
      current.textNode.appendData(f.text); // a text node: model output is never HTML
    }
    scrollIfFollowing(follow);
  }

  // A reasoning model's thinking (served with --reasoning-parser) goes in a fold above the
  // answer, open while it streams; the history keeps only the answer, as its templates do.
  function thinking(gen) {
    if (!gen.thinking) {
      const fold = document.createElement("details");
      fold.className = "thinking";
      fold.open = true;
      const summary = document.createElement("summary");
      summary.textContent = "Thinking";
      const body = document.createElement("div");
      gen.thinking = document.createTextNode("");
      body.appendChild(gen.thinking);
      fold.append(summary, body);
      gen.el.insertBefore(fold, gen.el.querySelector(".text"));
    }
    return gen.thinking;
  }

  function statsLine(gen, finishReason, usage) {
    const tokens = usage ? usage.completion_tokens : gen.tokens;
    const parts = [`${tokens} tokens`];
    if (gen.tFirst !== null) {
      parts.push(`TTFT ${Math.round(gen.tFirst - gen.tSent)} ms`);
      // Decode speed: tokens after the first over the time since the first, which is what
      // an operator compares across loads (TTFT is reported on its own).
      const span = (gen.tLast - gen.tFirst) / 1000;
      if (tokens > 1 && span > 0) parts.push(`${((tokens - 1) / span).toFixed(1)} tok/s`);
    }
    parts.push(`${((performance.now() - gen.tSent) / 1000).toFixed(2)} s`);
    parts.push(`finish: ${finishReason}`);
    return parts.join(" · ");
  }

  function onDone(f) {
    if (current === null || f.id !== current.id) return;
    const gen = current;
    current = null;
    gen.el.classList.remove("streaming");
    gen.el.dataset.finish = f.finish_reason;
    addLine(gen.el, "stats", statsLine(gen, f.finish_reason, f.usage));
    if (gen.text) {
      // A stopped reply keeps what was shown: the next turn continues from what the user saw.
      history.push({ role: "assistant", content: gen.text, el: gen.el });
    } else {
      dropTurn(gen, "the reply was empty, so this turn is left out of the history");
    }
    updateButtons();
  }

  function dropTurn(gen, why) {
    // Leave a failed exchange out of the history, so one bad turn does not poison every
    // later request (e.g. a prompt that is too long).
    history = history.filter((t) => t !== gen.userTurn);
    for (const el of [gen.userTurn.el, gen.el]) {
      el.classList.add("excluded");
      el.title = why;
    }
  }

  function failCurrent(message) {
    const gen = current;
    current = null;
    gen.el.classList.remove("streaming");
    gen.el.dataset.finish = "error";
    addLine(gen.el, "error", message);
    dropTurn(gen, "this turn failed and is left out of the history");
    // Give the message back so it can be sent again.
    if (!els.input.value) els.input.value = gen.userTurn.content;
    updateButtons();
  }

  function onError(f) {
    const where = f.param ? ` (${f.param})` : "";
    const message = `error ${f.code}: ${f.message}${where}`;
    // A generate frame the server cannot decode (say temperature 5) gets an error with id
    // null, since the id never got parsed.  We only send generate and cancel (always valid)
    // and run one generation at a time, so before any output it can only be ours.
    const ours =
      current !== null &&
      (f.id === current.id || ((f.id === null || f.id === undefined) && current.tFirst === null));
    if (ours) {
      failCurrent(message);
    } else if (f.id !== null && f.code === 404) {
      // A cancel that crossed the generation's `done` on the wire: nothing to report.
    } else if (f.id === null || f.id === undefined) {
      notice(message);
    }
    // Errors for generations we already dropped (New chat) are ignored.
  }

  function onFrame(data) {
    let f;
    try {
      f = JSON.parse(data);
    } catch {
      notice("the server sent a frame that is not JSON");
      return;
    }
    if (current !== null && f.id === current.id && Number.isInteger(f.seq)) {
      if (f.seq <= current.seq) return; // shown already (a resume starts after it)
      current.seq = f.seq;
    }
    if (f.type === "delta") onDelta(f);
    else if (f.type === "done") onDone(f);
    else if (f.type === "error") onError(f);
    // "pong" needs nothing: the server's WebSocket heartbeat detects dead connections.
  }

  // ------------------------------------------------------------------ wiring
  els.composer.addEventListener("submit", (ev) => {
    ev.preventDefault();
    send();
  });
  els.input.addEventListener("keydown", (ev) => {
    // Enter sends, Shift+Enter is a newline; isComposing keeps IME input (e.g. Chinese)
    // from sending when Enter only confirms a candidate.
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      send();
    }
  });
  els.stop.addEventListener("click", stop);
  document.addEventListener("keydown", (ev) => {
    if (ev.key === "Escape" && current !== null) stop();
  });
  els.newChat.addEventListener("click", newChat);
  for (const name of PERSISTED) els[name].addEventListener("change", saveSettings);
  els.apiKey.addEventListener("change", () => {
    storageSet(API_KEY_KEY, els.apiKey.value.trim());
    connectedOnce = false;
    reconnectNow();
  });
  // Coming back online: do not wait out the backoff.
  window.addEventListener("online", () => {
    if (!isOpen()) reconnectNow();
  });

  loadSettings();
  connect();
  els.input.focus();
})();
