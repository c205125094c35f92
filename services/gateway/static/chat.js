// The chat playground: the conversation goes to POST /v1/chat/completions with "stream": true and
// each server-sent event's delta is appended to the answer as it arrives. Cancel aborts the fetch
// (AbortController); the edge then resets the stream and the gateway aborts the engine request.
"use strict";

const chat = {
  messages: [],          // the conversation sent with every request: {role, content}
  controller: null,      // the AbortController of the request in flight
  el: {
    model: document.getElementById("model"),
    temperature: document.getElementById("temperature"),
    maxTokens: document.getElementById("max-tokens"),
    stop: document.getElementById("stop"),
    messages: document.getElementById("messages"),
    prompt: document.getElementById("prompt"),
    send: document.getElementById("send"),
    cancel: document.getElementById("cancel"),
    clear: document.getElementById("clear"),
    error: document.getElementById("chat-error"),
  },
};

async function loadModels() {
  try {
    const response = await fetch("/v1/models", { headers: apiHeaders() });
    if (!response.ok) throw new Error(await errorText(response));
    const body = await response.json();
    chat.el.model.replaceChildren(...body.data.map((m) => new Option(m.id, m.id)));
    showError("");
  } catch (err) {
    showError("Cannot list the models: " + err.message);
  }
}

function showError(text) {
  chat.el.error.textContent = text;
  chat.el.error.hidden = !text;
}

function addMessage(role, content) {
  const div = document.createElement("div");
  div.className = "message " + role;
  const label = document.createElement("span");
  label.className = "role";
  label.textContent = role;
  const text = document.createElement("span");
  text.className = "text";
  text.textContent = content;
  div.append(label, text);
  chat.el.messages.append(div);
  chat.el.messages.scrollTop = chat.el.messages.scrollHeight;
  return { div, text };
}

function requestBody() {
  const body = {
    model: chat.el.model.value,
    messages: chat.messages,
    stream: true,
    temperature: Number(chat.el.temperature.value),
    max_tokens: Number(chat.el.maxTokens.value),
  };
  // "\n" in the field means a newline, so that paragraph breaks can be stop strings.
  const stop = chat.el.stop.value.split(",").map((s) => s.replaceAll("\\n", "\n")).filter((s) => s);
  if (stop.length) body.stop = stop;
  return body;
}

// Parse server-sent events out of the byte stream; call onEvent with each JSON payload.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

async function send(event) {
  event.preventDefault();
  const prompt = chat.el.prompt.value.trim();
  if (!prompt || chat.controller) return;
  showError("");
  chat.messages.push({ role: "user", content: prompt });
  addMessage("user", prompt);
  chat.el.prompt.value = "";
  const answer = addMessage("assistant", "");
  answer.div.classList.add("streaming");
  chat.controller = new AbortController();
  setBusy(true);
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: apiHeaders(), body: JSON.stringify(requestBody()), signal: chat.controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        answer.text.textContent += delta.content;
        chat.el.messages.scrollTop = chat.el.messages.scrollHeight;
      }
    });
    chat.messages.push({ role: "assistant", content: answer.text.textContent });
  } catch (err) {
    if (err.name === "AbortError") {
      answer.div.dataset.cancelled = "true";
      answer.text.textContent += " [cancelled]";
    } else {
      showError(err.message);
    }
    chat.messages.pop();  // the unanswered question leaves the conversation
  } finally {
    answer.div.classList.remove("streaming");
    answer.div.dataset.done = "true";
    chat.controller = null;
    setBusy(false);
  }
}

function setBusy(busy) {
  chat.el.send.disabled = busy;
  chat.el.cancel.disabled = !busy;
}

chat.el.cancel.addEventListener("click", () => chat.controller && chat.controller.abort());
chat.el.clear.addEventListener("click", () => {
  chat.messages = [];
  chat.el.messages.replaceChildren();
});
document.getElementById("composer").addEventListener("submit", send);
chat.el.prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) send(e);
});
keyInput.addEventListener("change", loadModels);
loadModels();
