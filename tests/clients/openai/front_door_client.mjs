// The official OpenAI Node.js client (npm `openai`, v6) pointed at a kvr node's front door, as an
// application would use it: list the models, stream a chat completion and a completion with usage,
// repeat a long prompt until the engine's cache serves it, and see an error the SDK's way.
// Usage: node front_door_client.mjs http://127.0.0.1:PORT/v1 MODEL
// Prints one line per check; exits 1 with the reason when one fails.
import assert from 'node:assert/strict';
import OpenAI, { NotFoundError } from 'openai';

const [baseURL, model] = process.argv.slice(2);
assert.ok(baseURL && model, 'usage: front_door_client.mjs BASE_URL MODEL');
const client = new OpenAI({ baseURL, apiKey: 'not-checked', maxRetries: 0, timeout: 30_000 });

async function main() {
  const models = [];
  for await (const entry of client.models.list()) models.push(entry.id);
  assert.ok(models.includes(model), `models.list() gives ${JSON.stringify(models)}`);
  console.log(`models: ${models.join(', ')}`);

  const chat = await client.chat.completions.create({
    model,
    messages: [{ role: 'user', content: 'Say something about routers.' }],
    max_tokens: 5,
    stream: true,
    stream_options: { include_usage: true },
  });
  let text = '';
  let usage = null;
  for await (const chunk of chat) {
    text += chunk.choices[0]?.delta?.content ?? '';
    if (chunk.usage) usage = chunk.usage;
  }
  assert.ok(text.length > 0, 'the chat stream carried no content');
  assert.equal(usage?.completion_tokens, 5, `chat usage ${JSON.stringify(usage)}`);
  console.log(`chat stream: ${JSON.stringify(text)}, usage ${JSON.stringify(usage)}`);

  const completion = await client.completions.create({
    model, prompt: 'Once upon a time', max_tokens: 3, stream: true,
  });
  let pieces = 0;
  let finish = null;
  for await (const chunk of completion) {
    pieces += 1;
    finish = chunk.choices[0]?.finish_reason ?? finish;
  }
  assert.equal(finish, 'length', `completion finished with ${finish}`);
  console.log(`completion stream: ${pieces} chunks, finish_reason ${finish}`);

  // A long system prompt, asked again until the engine's cache serves it (the node learns the
  // engine's blocks from its KV events a moment after the first answer).
  const system = 'You are a careful assistant for caches. '.repeat(40);
  const ask = () => client.chat.completions.create({
    model,
    max_tokens: 2,
    messages: [{ role: 'system', content: system }, { role: 'user', content: 'Hello?' }],
  }).withResponse();
  // A repeat sent before the first answer's KV events reached the node may go to another worker
  // (which then holds the prompt too): the hit must come from a worker that served it before.
  const first = await ask();
  const servedBy = new Set([first.response.headers.get('x-kvr-worker-id')]);
  let cached = 0;
  let worker = null;
  for (let attempt = 0; attempt < 50 && cached === 0; attempt += 1) {
    const again = await ask();
    cached = again.data.usage?.prompt_tokens_details?.cached_tokens ?? 0;
    worker = again.response.headers.get('x-kvr-worker-id');
    if (cached === 0) servedBy.add(worker);
  }
  assert.ok(cached > 0, 'a repeated long prompt never hit the cache');
  assert.ok(servedBy.has(worker), `the hit came from worker ${worker}, which never served the prompt`);
  console.log(`cache hit: ${cached} cached prompt tokens on worker ${worker}`);

  await assert.rejects(
    client.chat.completions.create({ model: 'no-such-model', messages: [{ role: 'user', content: 'x' }] }),
    (error) => error instanceof NotFoundError && error.status === 404 && error.code === 'model_not_found',
  );
  console.log('unknown model: NotFoundError 404 model_not_found');
}

main().catch((error) => {
  console.error(`FAILED: ${error?.stack ?? error}`);
  process.exit(1);
});
