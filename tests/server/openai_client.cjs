// Streams from burst-server with the official OpenAI Node SDK: /v1/completions (text assembled
// from the chunks equals the non-streaming answer; usage arrives with include_usage), the
// canonical `chunk.choices[0]?.delta` loop over a stream with return_progress, logprobs
// (completions and chat, streaming and not), vLLM's extras (min_p, include_stop_str_in_output,
// continuous_usage_stats, no-op metadata), refused parameters (400 naming them) and, when
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
  // return_progress: progress chunks (empty choices) pass through the SDK's canonical loop.
  const prog = await client.completions.create({
    model, prompt, max_tokens: 6, temperature: 0, stream: true, return_progress: true });
  let ptext = "", progress = 0;
  for await (const chunk of prog) {
    ptext += chunk.choices[0]?.text || "";
    if (chunk.progress) progress += 1;
  }
  check(progress >= 2 && ptext === want.slice(0, ptext.length) && ptext.length > 0,
        `progress stream: ${progress} progress chunks, text ${JSON.stringify(ptext)}`);
  console.log(`ok   completions stream with return_progress (${progress} progress chunks)`);
  // logprobs: N (completions), streaming and not: the same tokens and values.
  const lp = await client.completions.create({
    model, prompt, max_tokens: 5, temperature: 0, logprobs: 2 });
  const l = lp.choices[0].logprobs;
  check(l.tokens.length === 5 && l.token_logprobs.length === 5 && l.top_logprobs.length === 5,
        "completions logprobs " + JSON.stringify(l));
  check(l.tokens.join("") === lp.choices[0].text, "logprob tokens spell the text");
  const lps = await client.completions.create({
    model, prompt, max_tokens: 5, temperature: 0, logprobs: 2, stream: true });
  let stoks = [], svals = [];
  for await (const chunk of lps) {
    const c = chunk.choices[0];
    if (c?.logprobs) { stoks.push(...c.logprobs.tokens); svals.push(...c.logprobs.token_logprobs); }
  }
  check(JSON.stringify(stoks) === JSON.stringify(l.tokens) &&
        svals.every((v, i) => Math.abs(v - l.token_logprobs[i]) < 1e-6),
        "streamed logprobs " + JSON.stringify([stoks, svals]));
  console.log("ok   completions logprobs, streaming and not");
  // echo with logprobs: the prompt's tokens first (the first without a logprob), then the
  // generated ones.
  const ec = await client.completions.create({
    model, prompt, max_tokens: 2, temperature: 0, echo: true, logprobs: 1 });
  const el = ec.choices[0].logprobs;
  check(ec.choices[0].text.startsWith(prompt) && el.token_logprobs[0] === null &&
        el.token_logprobs.slice(1).every((v) => typeof v === "number" && v <= 0) &&
        el.tokens.length === ec.usage.prompt_tokens + 2,
        "echo + logprobs " + JSON.stringify(ec));
  console.log(`ok   echo with prompt logprobs (${el.tokens.length} tokens)`);
  // n = 2 with a seed: two choices, choice i sampled with seed + i.
  const two = await client.completions.create({ model, prompt, max_tokens: 8, n: 2, seed: 11 });
  const a = await client.completions.create({ model, prompt, max_tokens: 8, seed: 11 });
  const b = await client.completions.create({ model, prompt, max_tokens: 8, seed: 12 });
  const byIndex = Object.fromEntries(two.choices.map((c) => [c.index, c.text]));
  check(byIndex[0] === a.choices[0].text && byIndex[1] === b.choices[0].text,
        "n = 2 with seeds: " + JSON.stringify([byIndex, a.choices[0].text, b.choices[0].text]));
  console.log("ok   n = 2 with a seed");
  // A client configured for vLLM: its extras pass through the SDK and do what they say.
  // min_p 1 keeps only the most likely id (a hot sampler then draws greedy's text);
  // include_stop_str_in_output keeps the stop string; continuous_usage_stats puts usage in
  // every chunk; metadata, service_tier and user are accepted and change nothing.
  const hot = await client.completions.create({
    model, prompt, max_tokens: 12, temperature: 5, seed: 3, min_p: 1,
    metadata: { job: "eval" }, service_tier: "auto", user: "u1", skip_special_tokens: true });
  check(hot.choices[0].text === want, `min_p 1: ${JSON.stringify(hot.choices[0].text)}`);
  const stop = want.slice(4, 7);
  const kept = await client.completions.create({
    model, prompt, max_tokens: 12, temperature: 0, stop: [stop],
    include_stop_str_in_output: true });
  check(kept.choices[0].text === want.slice(0, want.indexOf(stop) + stop.length),
        `include_stop_str_in_output: ${JSON.stringify(kept.choices[0].text)} (stop ${stop})`);
  const counted = await client.completions.create({
    model, prompt, max_tokens: 6, temperature: 0, ignore_eos: true, stream: true,
    stream_options: { continuous_usage_stats: true } });
  const seen = [];
  for await (const chunk of counted) seen.push(chunk.usage ? chunk.usage.completion_tokens : -1);
  check(seen.length >= 6 && seen.every((n, i) => n >= 0 && (i === 0 || n >= seen[i - 1])) &&
        seen[seen.length - 1] === 6, `continuous_usage_stats: ${JSON.stringify(seen)}`);
  console.log("ok   vLLM extras: min_p, include_stop_str_in_output, continuous_usage_stats");
  // Refused parameters: 400 naming the parameter.
  for (const [extra, param] of [[{ suffix: "amen" }, "suffix"],
                                [{ best_of: 3, n: 4 }, "best_of"],
                                [{ frequency_penalty: "abc" }, "frequency_penalty"],
                                [{ echo: "yes" }, "echo"], [{ n: 0 }, "n"]]) {
    try {
      await client.completions.create({ model, prompt, max_tokens: 2, ...extra });
      check(false, `${param} must be refused`);
    } catch (e) {
      check(e.status === 400 && e.param === param && e.message.includes(param),
            `${param}: got ${e.status} ${e.param} ${e.message}`);
    }
  }
  console.log("ok   refused parameters: 400 naming them");
  if (process.env.CHAT === "1") {
    const cl = await client.chat.completions.create({
      model, max_tokens: 4, temperature: 0, logprobs: true, top_logprobs: 2,
      messages: [{ role: "user", content: "Who made the heaven and the earth?" }] });
    const content = cl.choices[0].logprobs.content;
    check(content.length >= 1 && content.every((e) => e.top_logprobs.length === 2 &&
          Math.abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6),
          "chat logprobs " + JSON.stringify(content));
    const cls = await client.chat.completions.create({
      model, max_tokens: 4, temperature: 0, logprobs: true, top_logprobs: 2, stream: true,
      return_progress: true,
      messages: [{ role: "user", content: "Who made the heaven and the earth?" }] });
    let n = 0, said = "";
    for await (const chunk of cls) {
      said += chunk.choices[0]?.delta?.content || "";  // the SDKs' canonical loop
      n += chunk.choices[0]?.logprobs?.content?.length || 0;
    }
    check(n === content.length, `streamed chat logprobs: ${n} != ${content.length}`);
    check(said === cl.choices[0].message.content, `chat stream ${JSON.stringify(said)}`);
    console.log("ok   chat logprobs, streaming (with return_progress) and not");
    for (const [extra, param] of [[{ tools: [{ type: "function", function: { name: "f" } }] }, "tools"],
                                  [{ response_format: { type: "json_object" } }, "response_format"]]) {
      try {
        await client.chat.completions.create({
          model, max_tokens: 2, messages: [{ role: "user", content: "hi" }], ...extra });
        check(false, `${param} must be refused`);
      } catch (e) {
        check(e.status === 400 && e.param === param, `${param}: got ${e.status} ${e.param}`);
      }
    }
    console.log("ok   chat: tools and response_format refused, naming them");
  }
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
