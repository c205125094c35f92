// What the chat and status pages share: the API key field and authenticated fetches to the same
// origin (the Envoy edge that served this page).
"use strict";

const keyInput = document.getElementById("api-key");
keyInput.value = sessionStorage.getItem("gridserve-api-key") || "";
keyInput.addEventListener("change", () => sessionStorage.setItem("gridserve-api-key", keyInput.value));

function apiHeaders() {
  const headers = { "Content-Type": "application/json" };
  if (keyInput.value) headers["Authorization"] = "Bearer " + keyInput.value;
  return headers;
}

// The error message of a failed response: OpenAI's {"error": {"message"}}, a transcoded gRPC
// status {"message"}, or the HTTP status line.
async function errorText(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    return (body.error && body.error.message) || body.message || text;
  } catch (_) {
    return `HTTP ${response.status} ${text}`.trim();
  }
}

// Show one page (#chat or #status) from the URL's hash.
function showPage() {
  const name = location.hash === "#status" ? "status" : "chat";
  for (const page of document.querySelectorAll(".page")) page.hidden = page.id !== name;
  for (const link of document.querySelectorAll("nav a")) link.classList.toggle("active", link.id === "nav-" + name);
  document.dispatchEvent(new CustomEvent("page", { detail: name }));
}
window.addEventListener("hashchange", showPage);
