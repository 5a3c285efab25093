// The runner's Pi extension (loaded with `pi --no-extensions -e pi_extension.js`): per-attempt turn
// and token limits, and the sampling settings of the attempt's model calls.
//
// Pi has no turn or token limits of its own. At a limit this aborts the agent loop (print mode then
// exits) and appends a `jaxpi.limit` entry to the session file, so the runner can say why the
// attempt ended. Pi also sends no temperature / top_p / seed; a rollout needs them (greedy
// evaluation, the trainer's sampling temperature, reproducible attempts), so they are added to each
// request's payload here. Everything comes from the environment the runner sets:
//   JAXPI_MAX_TURNS   assistant turns that may end with tool calls (0 = no limit)
//   JAXPI_MAX_TOKENS  output tokens of the whole attempt, as the server's usage reports them
//   JAXPI_TEMPERATURE, JAXPI_TOP_P   sampling (unset = the server's defaults)
//   JAXPI_SEED        seed of the first call; call k sends seed + k (unset = no seed)
export default function (pi) {
  const env = process.env;
  const maxTurns = Number(env.JAXPI_MAX_TURNS || "0");
  const maxTokens = Number(env.JAXPI_MAX_TOKENS || "0");
  let turns = 0;
  let tokens = 0;
  let calls = 0;
  let hit = null;
  pi.on("before_provider_request", (event) => {
    const payload = { ...event.payload };
    if (env.JAXPI_TEMPERATURE) payload.temperature = Number(env.JAXPI_TEMPERATURE);
    if (env.JAXPI_TOP_P) payload.top_p = Number(env.JAXPI_TOP_P);
    if (env.JAXPI_SEED) payload.seed = Number(env.JAXPI_SEED) + calls;
    calls += 1;
    return payload;
  });
  pi.on("turn_end", async (event, ctx) => {
    turns += 1;
    const usage = event.message && event.message.usage;
    tokens += usage && typeof usage.output === "number" ? usage.output : 0;
    if (hit !== null) return;
    // A turn that ran tool calls wants another; at the turn limit it does not get one.
    if (maxTurns > 0 && turns >= maxTurns && (event.toolResults || []).length > 0) hit = "max_turns";
    else if (maxTokens > 0 && tokens >= maxTokens) hit = "max_tokens";
    if (hit !== null) {
      pi.appendEntry("jaxpi.limit", { reason: hit, turns, output_tokens: tokens });
      ctx.abort();
    }
  });
}
