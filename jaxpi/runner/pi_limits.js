// Turn and token limits for one Pi attempt (loaded with `pi --no-extensions -e pi_limits.js`).
// Pi has no such limits of its own; at the limit this aborts the agent loop (print mode then exits)
// and appends a `jaxpi.limit` entry to the session file so the runner can say why the attempt ended.
// The limits come from the environment the runner sets: JAXPI_MAX_TURNS, JAXPI_MAX_TOKENS
// (output tokens of the whole attempt, as the server reports them in each call's usage).
export default function (pi) {
  const maxTurns = Number(process.env.JAXPI_MAX_TURNS || "0");
  const maxTokens = Number(process.env.JAXPI_MAX_TOKENS || "0");
  let turns = 0;
  let tokens = 0;
  let hit = null;
  pi.on("turn_end", async (event, ctx) => {
    turns += 1;
    const usage = event.message && event.message.usage;
    tokens += usage && typeof usage.output === "number" ? usage.output : 0;
    if (hit !== null) return;
    if (maxTurns > 0 && turns >= maxTurns && (event.toolResults || []).length > 0) hit = "max_turns";
    else if (maxTokens > 0 && tokens >= maxTokens) hit = "max_tokens";
    if (hit !== null) {
      pi.appendEntry("jaxpi.limit", { reason: hit, turns, output_tokens: tokens });
      ctx.abort();
    }
  });
}
