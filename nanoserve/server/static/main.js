// The page's start: the chat (chat.js), the engine view (engine.js), and what the top bar says of the server.

import { apiFetch, askForKey, errorMessage } from "./api.js";
import { startChat } from "./chat.js";
import { startEngineView } from "./engine.js";

const chat = startChat();

async function describeServer() {
  const info = document.getElementById("server-info");
  const models = await apiFetch("/v1/models");
  if (!models.ok) {
    info.textContent = await errorMessage(models);
    return;
  }
  chat.setModels((await models.json()).data.map((m) => m.id));
  const stats = await apiFetch("/v1/engine/stats");
  if (!stats.ok) return;
  const c = (await stats.json()).config;
  info.textContent = `${c.model} · ${c.device} · ${c.dtype} · max ${c.max_model_len} tokens · v${c.version}`;
  const where = c.data_parallel_size > 1
    ? `${c.data_parallel_size} engine replicas (their KV pools side by side below)`
    : c.engine_process ? "engine process" : "engine thread";
  const server = c.api_server === null ? "" : ` · API server ${c.api_server}`;
  document.getElementById("engine-config").textContent =
    `block size ${c.block_size} · max ${c.max_num_seqs} seqs · ${c.max_num_batched_tokens} tokens/step · `
    + `prefix cache ${c.enable_prefix_caching ? "on" : "off"} · ${where}${server}`;
}

document.getElementById("key-button").addEventListener("click", async () => {
  if (await askForKey()) location.reload();
});

describeServer().finally(startEngineView);
