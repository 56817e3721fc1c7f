// llama.cpp itself on GGUF files (those `qtool quantize --format gguf` writes, and the float one
// they came from): load each on the CPU with node-llama-cpp's prebuilt llama.cpp, greedily answer
// one chat prompt through the model's own chat template, and score a fixed paragraph (the one
// scripts/gguf_smollm2.py scores with transformers): perplexity from llama.cpp's own next-token
// probabilities. Prints one JSON line per file, then a Markdown table; exits 1 if a file did not
// load or run, or llama.cpp logged an error for it. Needs npm; not run in CI (a test,
// tests/interop/test_gguf_llamacpp.py, runs it where node-llama-cpp resolves).
//
//   mkdir -p /tmp/nlc && cd /tmp/nlc && npm init -y && npm i -E node-llama-cpp@3.21.1
//   NODE_PATH=/tmp/nlc/node_modules node scripts/llamacpp_check.mjs [--threads 1]
//       [--tokens 20] [--decode 32] [--no-ppl] smol-bf16.gguf smol-Q8_0.gguf ...
//
// (ES modules ignore NODE_PATH, so the script resolves node-llama-cpp from NODE_PATH itself.)
// `npm i` may warn that node-llama-cpp's postinstall script was not run: the prebuilt binaries
// (@node-llama-cpp/linux-x64) need no postinstall. The script never builds llama.cpp from source
// (build: "never"): if the prebuilt binary cannot load, it stops with node-llama-cpp's message.

import { createRequire } from "node:module";
import { readFileSync, statSync } from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const PROMPT = "What is the capital of France? Answer in one sentence.";
const TEXT =
  "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. " +
  "It is named after the engineer Gustave Eiffel, whose company designed and built the " +
  "tower from 1887 to 1889. Locally nicknamed the Iron Lady, it was constructed as the " +
  "centrepiece of the 1889 World's Fair, and to crown the centennial anniversary of the " +
  "French Revolution. Although initially criticised by some of France's leading artists and " +
  "intellectuals for its design, it has since become a global cultural icon of France and " +
  "one of the most recognisable structures in the world.";

function parseArgs(argv) {
  const opts = { threads: 1, tokens: 20, decode: 32, ppl: true, files: [] };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === "--threads") opts.threads = Number(argv[++i]);
    else if (a === "--tokens") opts.tokens = Number(argv[++i]);
    else if (a === "--decode") opts.decode = Number(argv[++i]);
    else if (a === "--no-ppl") opts.ppl = false;
    else opts.files.push(a);
  }
  if (opts.files.length === 0) {
    console.error("usage: node scripts/llamacpp_check.mjs [--threads N] [--tokens N] [--decode N] [--no-ppl] FILE.gguf ...");
    process.exit(2);
  }
  return opts;
}

// node-llama-cpp from the current directory or NODE_PATH: [module, its version].
async function importNodeLlamaCpp() {
  const roots = [process.cwd(), ...(process.env.NODE_PATH ?? "").split(path.delimiter).filter(Boolean)];
  for (const root of roots) {
    const require = createRequire(path.join(path.resolve(root), "noop.js"));
    let where;
    try {
      where = require.resolve("node-llama-cpp");
    } catch {
      continue;
    }
    const pkg = path.join(where.slice(0, where.lastIndexOf("node-llama-cpp") + 14), "package.json");
    return [await import(pathToFileURL(where).href), JSON.parse(readFileSync(pkg, "utf8")).version];
  }
  return [await import("node-llama-cpp"), "unknown"];
}

// Perplexity of TEXT (no special tokens, as transformers tokenizes it in gguf_smollm2.py): each
// token after the first is scored by llama.cpp's probability for it at temperature 1, unfiltered.
async function perplexity(model, context) {
  const tokens = model.tokenize(TEXT);
  const sequence = context.getSequence();
  const sample = { temperature: 1, topK: 0, topP: 1, minP: 0 };
  const input = tokens.map((t, i) =>
    i < tokens.length - 1 ? [t, { generateNext: { probabilities: true, options: sample } }] : t,
  );
  const out = await sequence.controlledEvaluate(input);
  let nll = 0;
  for (let i = 0; i < tokens.length - 1; i++) {
    const p = out[i]?.next?.probabilities?.get(tokens[i + 1]) ?? 0;
    nll -= Math.log(Math.max(p, 1e-30));
  }
  sequence.dispose();
  return { tokens: tokens.length, ppl: Math.exp(nll / (tokens.length - 1)) };
}

// Decode speed on a fixed workload: greedy-generate `n` tokens after the paragraph's first 16,
// timed from the first generated token on, in wall seconds and in this process's CPU seconds
// (the latter barely moves with the machine's load; ggml's threads spin, so use --threads 1).
async function decodeSpeed(model, context, n) {
  const sequence = context.getSequence();
  let count = 0;
  let wall0 = 0;
  let cpu0 = null;
  for await (const token of sequence.evaluate(model.tokenize(TEXT).slice(0, 16), { temperature: 0 })) {
    void token;
    if (cpu0 === null) {
      wall0 = performance.now();
      cpu0 = process.cpuUsage();
    } else count++;
    if (count >= n) break;
  }
  const cpu = process.cpuUsage(cpu0);
  const wall = (performance.now() - wall0) / 1000;
  sequence.dispose();
  return { decodeTokens: count, decodeTps: count / wall, decodeTpsCpu: count / ((cpu.user + cpu.system) / 1e6) };
}

async function answer(model, context, LlamaChatSession, maxTokens) {
  const sequence = context.getSequence();
  const session = new LlamaChatSession({ contextSequence: sequence });
  let count = 0;
  const start = performance.now();
  let first = null;
  const text = await session.prompt(PROMPT, {
    temperature: 0,
    maxTokens,
    onToken: (chunk) => {
      if (first === null) first = performance.now();
      count += chunk.length;
    },
  });
  const end = performance.now();
  session.dispose();
  sequence.dispose();
  // tokens per second of generation, after the first token (which includes the prompt's decode)
  const tps = count > 1 && first !== null ? (count - 1) / ((end - first) / 1000) : null;
  return { text, count, tps, seconds: (end - start) / 1000 };
}

async function checkFile(llama, lib, file, opts) {
  const row = { file: path.basename(file), mb: statSync(file).size / 1e6 };
  const warnings = [];
  logged.current = warnings;
  const t0 = performance.now();
  let model;
  try {
    model = await llama.loadModel({ modelPath: file, gpuLayers: 0, useMmap: true });
  } catch (err) {
    return { ...row, load: `FAILED: ${String(err?.message ?? err)}`, warnings };
  }
  row.load = "ok";
  row.loadSeconds = (performance.now() - t0) / 1000;
  row.type = model.fileInfo?.metadata?.general?.file_type;
  try {
    const context = await model.createContext({ contextSize: 512, threads: opts.threads, sequences: 1 });
    const a = await answer(model, context, lib.LlamaChatSession, opts.tokens);
    Object.assign(row, { answer: a.text, answerTokens: a.count, tokensPerSecond: a.tps });
    if (opts.decode > 0) Object.assign(row, await decodeSpeed(model, context, opts.decode));
    if (opts.ppl) Object.assign(row, await perplexity(model, context));
    await context.dispose();
  } catch (err) {
    row.error = String(err?.message ?? err);
  }
  await model.dispose();
  row.warnings = warnings;
  return row;
}

const opts = parseArgs(process.argv.slice(2));
const [lib, version] = await importNodeLlamaCpp();
const logged = { current: [] }; // llama.cpp's warnings and errors, per file
const llama = await lib.getLlama({
  gpu: false,
  build: "never",
  logLevel: lib.LlamaLogLevel.warn,
  logger: (level, message) => {
    const line = `${level}: ${message.trim()}`;
    if (message.trim()) logged.current.push(line);
    process.stderr.write(line + "\n");
  },
});
const release = llama.llamaCppRelease;
console.log(
  JSON.stringify({
    nodeLlamaCpp: version,
    llamaCpp: release,
    buildType: llama.buildType,
    gpu: llama.gpu,
    threads: opts.threads,
    systemInfo: llama.systemInfo,
  }),
);
const rows = [];
for (const file of opts.files) {
  const row = await checkFile(llama, lib, file, opts);
  console.log(JSON.stringify(row));
  rows.push(row);
}
console.log("\n| file | size MB | load | answer (greedy, chat template) | decode tok/s (wall) | tok/CPU-s | perplexity |");
console.log("|---|---:|---|---|---:|---:|---:|");
for (const r of rows) {
  const ans = (r.answer ?? r.error ?? "")
    .replace(/\s+/g, " ")
    .replace(/[\x00-\x1f\x7f]/g, (c) => `\\x${c.charCodeAt(0).toString(16).padStart(2, "0")}`)
    .replace(/\|/g, "\\|");
  const tps = r.decodeTps == null ? "-" : r.decodeTps.toFixed(1);
  const cpu = r.decodeTpsCpu == null ? "-" : r.decodeTpsCpu.toFixed(1);
  const ppl = r.ppl == null ? "-" : r.ppl.toFixed(3);
  console.log(`| ${r.file} | ${r.mb.toFixed(1)} | ${r.load} | ${ans} | ${tps} | ${cpu} | ${ppl} |`);
}
await llama.dispose();
// exit 1 when a file did not load or did not run, or llama.cpp logged an error for it
const failed = rows.filter((r) => r.load !== "ok" || r.error || r.warnings.some((w) => w.startsWith("error")));
process.exitCode = failed.length > 0 ? 1 : 0;
