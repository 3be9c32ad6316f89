// Drive trioshed with the `ollama` npm library and the Vercel AI SDK's ollama-ai-provider-v2.
// Usage: node clients.mjs BASE_URL MODEL OLLAMA_STORE_MODEL  (MODEL should stop by itself: num_predict)
// Prints one JSON object of what each call returned (or the error it raised); the Python test
// (tests/e2e/test_node_clients.py) asserts on it. Every call is made, whatever the others did.
import { Ollama } from "ollama";
import { createOllama } from "ollama-ai-provider-v2";
import { generateText, streamText } from "ai";

const [base, model, storeModel] = process.argv.slice(2);
const out = {};

async function record(name, fn) {
  try {
    out[name] = { ok: await fn() };
  } catch (err) {
    out[name] = { error: String(err && err.message ? err.message : err), status: err && (err.status_code ?? err.statusCode) };
  }
}

const client = new Ollama({ host: base });
await record("list", async () => (await client.list()).models.map((m) => m.name));
await record("show", async () => (await client.show({ model: storeModel })).capabilities);
await record("generate", async () => {
  const r = await client.generate({ model, prompt: "hi", stream: false, options: { num_predict: 4, temperature: 0 } });
  return { done: r.done, eval_count: r.eval_count, response: r.response };
});
await record("generate_logprobs", async () => {
  const r = await client.generate({ model, prompt: "hi", stream: false, logprobs: true, top_logprobs: 2, options: { num_predict: 4, temperature: 0 } });
  return { response: r.response, logprobs: r.logprobs };
});
await record("chat_logprobs_stream", async () => {
  const entries = [];
  let text = "";
  for await (const part of await client.chat({ model, messages: [{ role: "user", content: "hi" }], stream: true, logprobs: true, top_logprobs: 1, options: { num_predict: 4, temperature: 0 } })) {
    text += part.message.content;
    entries.push(...(part.logprobs ?? []));
  }
  return { text, logprobs: entries };
});
await record("ps", async () => (await client.ps()).models.map((m) => m.name));
await record("copy", async () => (await client.copy({ source: model, destination: "node-copy" })).status);
await record("delete", async () => (await client.delete({ model: "node-copy" })).status);
await record("pull", async () => (await client.pull({ model: "llama3.2", stream: false })).status);
await record("create", async () => {
  const progress = [];
  for await (const part of await client.create({ model: "me/node-made", from: model, system: "Be brief.",
    parameters: { num_ctx: 512, stop: ["</s>"] }, stream: true })) progress.push(part.status);
  const shown = await client.show({ model: "me/node-made" });
  return { last: progress.slice(-2), system: shown.system, parameters: shown.parameters };
});
await record("create_bad", async () => (await client.create({ model: "node-bad", from: model, parameters: { num_ctx: "big" } })).status);
await record("push", async () => (await client.push({ model: "me/node-made", stream: false })).status);
await record("create_delete", async () => (await client.delete({ model: "me/node-made" })).status);

const provider = createOllama({ baseURL: `${base}/api` });
await record("vercel_generate", async () => {
  const r = await generateText({ model: provider.completion(model), prompt: "hi", maxRetries: 0,
    providerOptions: { ollama: {} }, maxOutputTokens: 4 });
  return { text: r.text, outputTokens: r.usage.outputTokens };
});
await record("vercel_generate_stream", async () => {
  const errors = [];
  const r = streamText({ model: provider.completion(model), prompt: "hi", maxRetries: 0, onError: ({ error }) => errors.push(String(error && error.message ? error.message : JSON.stringify(error))) });
  return { text: await r.text, finishReason: await r.finishReason, errors: errors.slice(0, 2) };
});
await record("vercel_chat", async () => {
  const r = await generateText({ model: provider(model), prompt: "hi", maxRetries: 0, maxOutputTokens: 5,
    providerOptions: { ollama: { options: { num_predict: 5 } } } });
  return { text: r.text, outputTokens: r.usage.outputTokens };
});
console.log(JSON.stringify(out));
