// What Pi itself would send the model for a session file: the oracle of tests/test_pi_sessions.py.
//
//   node pi_context.mjs <pi-coding-agent package dir> <pi-ai package dir>
//
// Reads one session-file path per stdin line; writes one JSON line per path:
// {"messages": [...], "tools": [...]} as pi-ai's openai-completions provider builds a request from
// the file's context at its last entry (Pi's own buildSessionContext, convertToLlm,
// convertMessages, getCurrentTools), with the provider settings jaxpi's runner gives Pi; or
// {"error": "..."} when Pi's code throws. Pi's modules are loaded from the installed package, so
// this is the release under test, not a copy of it.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [pkg, ai] = process.argv.slice(2);
const load = (dir, rel) => import(pathToFileURL(join(dir, rel)).href);
const sessions = await load(pkg, "dist/core/session-manager.js");
const messages = await load(pkg, "dist/core/messages.js");
const completions = await load(ai, "dist/api/openai-completions.js");
const transcript = await load(ai, "dist/utils/transcript.js");

// jaxpi's models.json model and compat (jaxpi/runner/pi_config.py); the fields convertMessages
// reads that jaxpi leaves out take a custom host's defaults (false).
const model = { id: "policy", name: "policy", api: "openai-completions", provider: "jaxpi", reasoning: true, input: ["text"] };
const compat = {
  supportsDeveloperRole: false,
  supportsStore: false,
  supportsStrictMode: false,
  supportsReasoningEffort: true,
  thinkingFormat: "openai",
  maxTokensField: "max_tokens",
  supportsMidConvoSystemMessages: false,
  supportsMidConvoToolAdditions: false,
  requiresToolResultName: false,
  requiresAssistantAfterToolResult: false,
  requiresNonNullAssistantContent: false,
  requiresThinkingAsText: false,
  requiresReasoningContentOnAssistantMessages: false,
};

function request(path) {
  const entries = readFileSync(path, "utf8")
    .split("\n")
    .filter((line) => line.trim())
    .map((line) => JSON.parse(line))
    .filter((e) => e.type !== "session");
  const ctx = sessions.buildSessionContext(entries);
  const llm = messages.convertToLlm(ctx.messages);
  const out = completions.convertMessages(model, { messages: llm }, compat);
  const tools = transcript.getCurrentTools(llm).map((t) => ({
    type: "function",
    function: { name: t.name, description: t.description, parameters: t.parameters },
  }));
  return { messages: out, tools, thinkingLevel: ctx.thinkingLevel };
}

let buffer = "";
process.stdin.setEncoding("utf8");
process.stdin.on("data", (chunk) => {
  buffer += chunk;
  let at;
  while ((at = buffer.indexOf("\n")) >= 0) {
    const path = buffer.slice(0, at);
    buffer = buffer.slice(at + 1);
    let reply;
    try {
      reply = request(path);
    } catch (e) {
      reply = { error: String(e && e.stack ? e.stack : e) };
    }
    process.stdout.write(JSON.stringify(reply) + "\n");
  }
});
