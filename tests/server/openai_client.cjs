// Streams from burst-server with the official OpenAI Node SDK: /v1/completions (text assembled
// from the chunks equals the non-streaming answer; usage arrives with include_usage) and, when
// the model has the chat vocabulary, /v1/chat/completions. Exits non-zero on any mismatch.
const OpenAI = require("openai");
const client = new OpenAI({ apiKey: "node-key", baseURL: process.env.BASE_URL });
const model = process.env.MODEL;
const prompt = process.env.PROMPT;

function check(cond, msg) {
  if (!cond) { console.error("FAIL: " + msg); process.exit(1); }
}

(async () => {
  const full = await client.completions.create({ model, prompt, max_tokens: 12, temperature: 0 });
  const want = full.choices[0].text;
  const stream = await client.completions.create({
    model, prompt, max_tokens: 12, temperature: 0, stream: true,
    stream_options: { include_usage: true } });
  let text = "", usage = null;
  for await (const chunk of stream) {
    if (chunk.choices.length) text += chunk.choices[0].text;
    if (chunk.usage) usage = chunk.usage;
  }
  check(text === want, `completions stream ${JSON.stringify(text)} != ${JSON.stringify(want)}`);
  check(usage && usage.completion_tokens === 12, "usage " + JSON.stringify(usage));
  console.log("ok   completions stream: " + JSON.stringify(text));
  if (process.env.CHAT === "1") {
    const chat = await client.chat.completions.create({
      model, max_tokens: 10, temperature: 0, stream: true,
      messages: [{ role: "user", content: "Who made the heaven and the earth?" }] });
    let reply = "";
    for await (const chunk of chat) reply += chunk.choices[0]?.delta?.content || "";
    check(reply.length > 0, "chat stream returned text");
    console.log("ok   chat stream: " + JSON.stringify(reply));
  } else {
    console.log("skip chat stream: the fixture model lacks the chat template's token ids");
  }
  try {
    await new OpenAI({ apiKey: "wrong", baseURL: process.env.BASE_URL })
      .completions.create({ model, prompt, max_tokens: 2 });
    check(false, "a wrong key must fail");
  } catch (e) {
    check(e.status === 401, "wrong key gives 401, got " + e.status);
    console.log("ok   wrong key: 401");
  }
})().catch((e) => { console.error("FAIL: " + e); process.exit(1); });
