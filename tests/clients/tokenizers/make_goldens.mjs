// Golden token ids and chat renderings for kvr's native tokenizer, from a reference implementation.
//
// What it does: for every tokenizer archive deploy/data/tokenizers/<family>.tar.xz (each holds
// <family>/tokenizer.json and <family>/tokenizer_config.json) it extracts the archive into a temp
// dir (`tar xJf`), loads the tokenizer with @huggingface/tokenizers (pure JS) and writes
//   tests/data/tokenizers/goldens/<family>.prompts.jsonl, one line per corpus prompt, in order:
//     {"name", "ids", "ids_no_special", "decoded"}
//     ids            = encode(prompt) with the special tokens a completions request gets
//     ids_no_special = encode(prompt, add_special_tokens=false)
//     decoded        = decode(ids_no_special, skip_special_tokens=false)
//   tests/data/tokenizers/goldens/<family>.chats.jsonl, only when tokenizer_config.json has a
//   chat_template, one line per corpus chat, in order:
//     {"name", "rendered", "ids"} with rendered = the template rendered by @huggingface/jinja in
//     the context transformers' apply_chat_template builds and ids = encode(rendered,
//     add_special_tokens=false), the way vLLM tokenizes a chat; or {"name", "error"} when the
//     template raises (the message is informational: compare the presence of "error", not its text).
// Inputs: tests/data/tokenizers/corpus/prompts.jsonl and chats.jsonl. The output is the same bytes on
// every run: nothing depends on time, locale or hash order.
//
// Run (Node >= 20, from the repo root):
//   cd tests/clients/tokenizers && npm ci && node make_goldens.mjs
//
// How the context and the encoding follow transformers (the ground truth vLLM runs), not the
// reference's own defaults:
// - Template context: messages, tools (null when the chat has none, as transformers passes
//   tools=None), documents (null), add_generation_prompt, then the tokenizer's special_tokens_map
//   (bos/eos/unk/sep/pad/cls/mask_token as strings, a {"content": ...} object reduced to its content,
//   unset or null ones left out; additional_special_tokens as a list), then the chat's optional
//   chat_template_kwargs (transformers' **kwargs, which override the special tokens).
// - BOS/EOS: transformers rebuilds the post-processor from tokenizer_config.json's add_bos_token /
//   add_eos_token when either key is present or tokenizer.json has no post-processor
//   (TokenizersBackend.update_post_processor; v4's LlamaTokenizerFast did it unconditionally, which
//   gives the same result for the archives here). @huggingface/tokenizers ignores those keys, so
//   this script applies the rule itself before loading. It matters for deepseek-v3: its tokenizer.json
//   post-processor (ByteLevel) adds nothing, but add_bos_token is true, so a completions request gets
//   <｜begin▁of▁sentence｜> (id 0) first.
// - decode: clean_up_tokenization_spaces is taken from tokenizer_config.json (false for all five).
//
// Known deviations of the reference from HF's Rust `tokenizers` and from Python's jinja2, and what
// is done about them:
// - Regex: @huggingface/tokenizers rewrites the Oniguruma split patterns to JS regexes. `(?i:'s|...)`
//   becomes an ASCII-only case fold ([sS]), while Rust folds with Unicode case folding, where
//   U+017F (long s) folds to s: gpt-oss pre-tokenizes "it'ſ" as one piece in Rust and as "it" + "'ſ"
//   here (prompt contractions_long_s; its ids still agree with tiktoken's, the merges never span the
//   cut). \p{...} classes follow the Unicode version of Node's ICU (process.versions.unicode), not
//   the tables compiled into the Rust build: code points assigned between the two versions can split
//   differently. Neither is corrected.
// - Cross-check: gpt-oss's vocabulary is tiktoken's o200k_base plus the harmony special tokens, so the
//   script also encodes every prompt with tiktoken (its Rust core, compiled to WASM) and reports the
//   prompts whose ids differ; only prompts holding harmony-only special-token text should.
// - Jinja (@huggingface/jinja 0.5.13), corrected by patchJinjaToFollowPython() below and checked at
//   start-up: `selectattr`/`rejectattr` dropped items that lack the attribute before applying the
//   test, so `selectattr("tool_calls", "undefined")` was always empty and Mistral's role-alternation
//   check never fired; `==`/`!=` compared dicts and lists by identity (Python: by value); `+` joined a
//   string with anything (a dict rendered as "[object Map]"), where Python raises TypeError.
// - Jinja, not corrected (the corpus avoids them): booleans print as true/false (Python: True/False);
//   a dict printed with {{ }} renders as JSON (Python: its repr); tojson writes a float with a zero
//   fraction as 1 (Python: 1.0) because JSON.parse already lost the difference; `|string` on a dict
//   raises.
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import { Environment, Interpreter, Template } from '@huggingface/jinja';
import { Tokenizer } from '@huggingface/tokenizers';
import { get_encoding as tiktokenEncoding } from 'tiktoken';

const here = path.dirname(fileURLToPath(import.meta.url));
const repo = path.resolve(here, '../../..');
const archiveDir = path.join(repo, 'deploy/data/tokenizers');
const corpusDir = path.join(repo, 'tests/data/tokenizers/corpus');
const goldenDir = path.join(repo, 'tests/data/tokenizers/goldens');

const SPECIAL_TOKEN_KEYS = ['bos_token', 'eos_token', 'unk_token', 'sep_token', 'pad_token', 'cls_token', 'mask_token'];
// Families whose vocabulary is a tiktoken encoding (plus special tokens): an independent check.
const TIKTOKEN_TWINS = { 'gpt-oss': 'o200k_base' };

function readJsonl(file) {
  return fs.readFileSync(file, 'utf8').split('\n').filter((line) => line.length > 0).map((line) => JSON.parse(line));
}

function assertUniqueNames(entries, what) {
  const seen = new Set();
  for (const { name } of entries) {
    if (typeof name !== 'string' || seen.has(name)) throw new Error(`${what}: missing or duplicate name ${name}`);
    seen.add(name);
  }
}

// A special token in tokenizer_config.json is a string, null, or an AddedToken object.
function tokenContent(value) {
  if (value === null || value === undefined) return null;
  return typeof value === 'string' ? value : value.content ?? null;
}

// transformers' special_tokens_map: only the tokens that are set, as strings.
function specialTokensMap(config) {
  const map = {};
  for (const key of SPECIAL_TOKEN_KEYS) {
    const content = tokenContent(config[key]);
    if (content) map[key] = content;
  }
  const extra = (config.additional_special_tokens ?? []).map(tokenContent).filter(Boolean);
  if (extra.length > 0) map.additional_special_tokens = extra;
  return map;
}

function tokenId(tokenizerJson, content) {
  const added = tokenizerJson.added_tokens.find((token) => token.content === content);
  if (added) return added.id;
  const id = tokenizerJson.model.vocab?.[content];
  if (id === undefined) throw new Error(`special token ${content} is not in the vocabulary`);
  return id;
}

// The post-processor transformers ends up with (see the header); returns whether it was rebuilt.
function applyTransformersPostProcessor(tokenizerJson, config) {
  const explicit = 'add_bos_token' in config || 'add_eos_token' in config;
  if (!explicit && tokenizerJson.post_processor !== null) return false;
  const bos = tokenContent(config.bos_token);
  const eos = tokenContent(config.eos_token);
  const addBos = Boolean(config.add_bos_token) && bos !== null;
  const addEos = Boolean(config.add_eos_token) && eos !== null;
  const special = (content, typeId) => ({ SpecialToken: { id: content, type_id: typeId } });
  const sequence = (id, typeId) => ({ Sequence: { id, type_id: typeId } });
  const single = [];
  const pair = [];
  if (addBos) single.push(special(bos, 0));
  single.push(sequence('A', 0));
  if (addEos) single.push(special(eos, 0));
  pair.push(...single);
  if (addBos) pair.push(special(bos, 1));
  pair.push(sequence('B', 1));
  if (addEos) pair.push(special(eos, 1));
  const specialTokens = {};
  for (const content of [addBos ? bos : null, addEos ? eos : null].filter(Boolean)) {
    specialTokens[content] = { id: content, ids: [tokenId(tokenizerJson, content)], tokens: [content] };
  }
  tokenizerJson.post_processor = { type: 'TemplateProcessing', single, pair, special_tokens: specialTokens };
  return true;
}

// Names of the prompts whose ids_no_special differ from the tiktoken encoding's (special-token text
// that tiktoken knows is encoded as its special token, like the tokenizer does).
function tiktokenDisagreements(encodingName, prompts, goldenLines) {
  const encoding = tiktokenEncoding(encodingName);
  try {
    return prompts.filter(({ prompt }, i) => {
      const expected = JSON.stringify(Array.from(encoding.encode(prompt, 'all')));
      return expected !== JSON.stringify(JSON.parse(goldenLines[i]).ids_no_special);
    }).map(({ name }) => name);
  } finally {
    encoding.free();
  }
}

// Brings @huggingface/jinja's evaluation of the constructs the corpus templates use in line with
// Python's jinja2 (see the header). It patches the Interpreter's (TypeScript-private) methods, so a
// version whose internals moved fails here instead of producing silently different goldens.
function patchJinjaToFollowPython() {
  const proto = Interpreter.prototype;
  for (const method of ['applyFilter', 'evaluateBinaryExpression', 'evaluate']) {
    if (typeof proto[method] !== 'function') throw new Error(`@huggingface/jinja has no Interpreter.${method}`);
  }
  const probe = new Environment();
  const classOf = (value) => {
    const name = `probe${probe.variables.size}`;
    return probe.set(name, value).constructor;
  };
  const IntegerValue = classOf(1);
  const FloatValue = classOf(1.5);
  const StringValue = classOf('');
  const BooleanValue = classOf(true);
  const ArrayValue = classOf([]);
  const UndefinedValue = classOf(undefined);

  const pythonType = (value) => ({
    IntegerValue: 'int', FloatValue: 'float', BooleanValue: 'bool', StringValue: 'str', NullValue: 'NoneType',
    ArrayValue: 'list', TupleValue: 'tuple', ObjectValue: 'dict', KeywordArgumentsValue: 'dict',
    UndefinedValue: 'Undefined',
  })[value.type] ?? value.type;
  const isNumeric = (value) => ['IntegerValue', 'FloatValue', 'BooleanValue'].includes(value.type);
  const isMapping = (value) => value.value instanceof Map;

  const pythonEqual = (a, b) => {
    if (isNumeric(a) && isNumeric(b)) return Number(a.value) === Number(b.value);
    if (a.type !== b.type && !(isMapping(a) && isMapping(b))) return false;
    if (a.type === 'StringValue') return a.value === b.value;
    if (a.type === 'NullValue' || a.type === 'UndefinedValue') return true;
    if (a.type === 'ArrayValue' || a.type === 'TupleValue') {
      return a.value.length === b.value.length && a.value.every((item, i) => pythonEqual(item, b.value[i]));
    }
    if (isMapping(a)) {
      if (a.value.size !== b.value.size) return false;
      for (const [key, item] of a.value) {
        if (!b.value.has(key) || !pythonEqual(item, b.value.get(key))) return false;
      }
      return true;
    }
    return a.value === b.value;
  };

  const originalBinary = proto.evaluateBinaryExpression;
  proto.evaluateBinaryExpression = function evaluateBinaryExpression(node, environment) {
    const operator = node.operator.value;
    if (operator !== '+' && operator !== '==' && operator !== '!=') {
      return originalBinary.call(this, node, environment);
    }
    const left = this.evaluate(node.left, environment);
    const right = this.evaluate(node.right, environment);
    if (operator !== '+') return new BooleanValue(pythonEqual(left, right) === (operator === '=='));
    if (left.type === 'StringValue' && right.type === 'StringValue') return new StringValue(left.value + right.value);
    if (left.type === 'ArrayValue' && right.type === 'ArrayValue') return new ArrayValue(left.value.concat(right.value));
    if (isNumeric(left) && isNumeric(right)) {
      const sum = Number(left.value) + Number(right.value);
      return left.type === 'FloatValue' || right.type === 'FloatValue' ? new FloatValue(sum) : new IntegerValue(sum);
    }
    if (left.type === 'StringValue') {
      throw new TypeError(`can only concatenate str (not "${pythonType(right)}") to str`);
    }
    throw new TypeError(`unsupported operand type(s) for +: '${pythonType(left)}' and '${pythonType(right)}'`);
  };

  const originalFilter = proto.applyFilter;
  proto.applyFilter = function applyFilter(operand, filterNode, environment) {
    const name = filterNode.type === 'CallExpression' ? filterNode.callee?.value : null;
    if ((name !== 'selectattr' && name !== 'rejectattr') || operand.type !== 'ArrayValue') {
      return originalFilter.call(this, operand, filterNode, environment);
    }
    const [attribute, testName, ...testArgs] = filterNode.args.map((arg) => this.evaluate(arg, environment));
    let test = (value) => value.__bool__().value;
    if (testName !== undefined) {
      const found = environment.tests.get(testName.value);
      if (!found) throw new Error(`no test named '${testName.value}'`);
      test = (value) => found(value, ...testArgs);
    }
    const select = name === 'selectattr';
    return new ArrayValue(operand.value.filter((item) => {
      const value = isMapping(item) ? item.value.get(attribute.value) ?? new UndefinedValue() : new UndefinedValue();
      return test(value) === select;
    }));
  };

  // The patched behaviour, checked against what jinja2 gives for the same template.
  const render = (source, context) => {
    try {
      return new Template(source).render(context);
    } catch (error) {
      return `raised: ${error.message}`;
    }
  };
  const checks = [
    ["{% for x in xs | selectattr('k', 'undefined') %}{{ x.n }}{% endfor %}", { xs: [{ n: 1 }, { n: 2, k: 3 }] }, '1'],
    ["{% for x in xs | rejectattr('k', 'defined') %}{{ x.n }}{% endfor %}", { xs: [{ n: 1 }, { n: 2, k: 3 }] }, '1'],
    ["{% for x in xs | selectattr('k', 'equalto', 'v') %}{{ x.n }}{% endfor %}", { xs: [{ n: 1 }, { n: 2, k: 'v' }] }, '2'],
    ['{% if a == b %}eq{% else %}ne{% endif %}', { a: { x: [1, 'y'] }, b: { x: [1, 'y'] } }, 'eq'],
    ['{% if a != b %}ne{% else %}eq{% endif %}', { a: [1, 2], b: [1, 3] }, 'ne'],
    ['{% if a == b %}eq{% else %}ne{% endif %}', { a: '1', b: 1 }, 'ne'],
    ["{{ 'a' + x }}", { x: { k: 1 } }, 'raised: can only concatenate str (not "dict") to str'],
    ["{{ 'a' + 'b' }}{{ 1 + 2 }}{{ 1 + 0.5 }}", {}, 'ab31.5'],
  ];
  for (const [source, context, expected] of checks) {
    const got = render(source, context);
    if (got !== expected) throw new Error(`jinja patch check failed: ${source} gave ${JSON.stringify(got)}`);
  }
}

function chatTemplateOf(config, hasTools) {
  const template = config.chat_template;
  if (template === undefined || template === null) return null;
  if (typeof template === 'string') return template;
  // A list of named templates: transformers picks "tool_use" for a request with tools, else "default".
  const named = new Map(template.map((entry) => [entry.name, entry.template]));
  return (hasTools && named.get('tool_use')) || named.get('default') || null;
}

function decode(tokenizer, ids, config) {
  if (ids.length === 0) return ''; // the reference refuses an empty list
  return tokenizer.decode(ids, {
    skip_special_tokens: false,
    clean_up_tokenization_spaces: config.clean_up_tokenization_spaces ?? false,
  });
}

function promptGoldens(tokenizer, config, prompts) {
  const lines = [];
  const roundTripMismatches = [];
  for (const { name, prompt } of prompts) {
    const ids = tokenizer.encode(prompt, { add_special_tokens: true }).ids;
    const idsNoSpecial = tokenizer.encode(prompt, { add_special_tokens: false }).ids;
    const decoded = decode(tokenizer, idsNoSpecial, config);
    if (decoded !== prompt) roundTripMismatches.push(name);
    lines.push(JSON.stringify({ name, ids, ids_no_special: idsNoSpecial, decoded }));
  }
  return { lines, roundTripMismatches };
}

function chatGoldens(tokenizer, config, chats) {
  const lines = [];
  const errors = [];
  const special = specialTokensMap(config);
  for (const chat of chats) {
    const source = chatTemplateOf(config, Boolean(chat.tools));
    const context = {
      ...special,
      ...(chat.chat_template_kwargs ?? {}),
      messages: chat.messages,
      tools: chat.tools ?? null,
      documents: null,
      add_generation_prompt: chat.add_generation_prompt,
    };
    let rendered;
    try {
      rendered = new Template(source).render(context);
    } catch (error) {
      errors.push(chat.name);
      lines.push(JSON.stringify({ name: chat.name, error: `${error.name}: ${error.message}` }));
      continue;
    }
    const ids = tokenizer.encode(rendered, { add_special_tokens: false }).ids;
    lines.push(JSON.stringify({ name: chat.name, rendered, ids }));
  }
  return { lines, errors };
}

function writeLines(file, lines) {
  fs.writeFileSync(file, lines.map((line) => `${line}\n`).join(''));
  return fs.statSync(file).size;
}

function main() {
  patchJinjaToFollowPython();
  const prompts = readJsonl(path.join(corpusDir, 'prompts.jsonl'));
  const chats = readJsonl(path.join(corpusDir, 'chats.jsonl'));
  assertUniqueNames(prompts, 'prompts.jsonl');
  assertUniqueNames(chats, 'chats.jsonl');
  fs.mkdirSync(goldenDir, { recursive: true });

  const families = fs.readdirSync(archiveDir).filter((file) => file.endsWith('.tar.xz')).sort()
    .map((file) => file.slice(0, -'.tar.xz'.length));
  if (families.length === 0) throw new Error(`no tokenizer archives in ${archiveDir}`);
  const scratch = fs.mkdtempSync(path.join(os.tmpdir(), 'kvr-goldens-'));
  try {
    for (const family of families) {
      execFileSync('tar', ['xJf', path.join(archiveDir, `${family}.tar.xz`), '-C', scratch]);
      const folder = path.join(scratch, family);
      const tokenizerJson = JSON.parse(fs.readFileSync(path.join(folder, 'tokenizer.json'), 'utf8'));
      const config = JSON.parse(fs.readFileSync(path.join(folder, 'tokenizer_config.json'), 'utf8'));
      const rebuilt = applyTransformersPostProcessor(tokenizerJson, config);
      const tokenizer = new Tokenizer(tokenizerJson, config);

      const promptFile = path.join(goldenDir, `${family}.prompts.jsonl`);
      const { lines, roundTripMismatches } = promptGoldens(tokenizer, config, prompts);
      const report = {
        family,
        post_processor_rebuilt: rebuilt,
        special_ids_added: tokenizer.encode('', { add_special_tokens: true }).ids,
        prompts: lines.length,
        prompts_bytes: writeLines(promptFile, lines),
        decode_differs_from_prompt: roundTripMismatches,
      };
      if (TIKTOKEN_TWINS[family]) {
        report[`differs_from_tiktoken_${TIKTOKEN_TWINS[family]}`] =
          tiktokenDisagreements(TIKTOKEN_TWINS[family], prompts, lines);
      }
      const chatFile = path.join(goldenDir, `${family}.chats.jsonl`);
      if (chatTemplateOf(config, false) !== null) {
        const result = chatGoldens(tokenizer, config, chats);
        report.chats = result.lines.length;
        report.chats_bytes = writeLines(chatFile, result.lines);
        report.chat_errors = result.errors;
      } else {
        fs.rmSync(chatFile, { force: true });
      }
      console.log(JSON.stringify(report));
      fs.rmSync(folder, { recursive: true, force: true });
    }
  } finally {
    fs.rmSync(scratch, { recursive: true, force: true });
  }
}

main();
