"""vLLM's ``vllm serve`` flags on our commands: a deployment script written for vLLM either runs, or
stops at its first flag with one line saying why and what to use instead; never argparse's usage
dump, never a flag silently dropped.

Three outcomes, decided before our parser sees the command line (``translate``):
- ours: the flag is one of our own (same name, same meaning: ``--max-model-len``, ``-tp``, ...);
- accepted: vLLM's flag for something that is already so here, or that nothing here would change;
  it is taken out with one line on stderr saying why (``--trust-remote-code``: the families we
  serve are implemented here, no checkpoint code runs). Some are accepted only at the value that
  matches what this server does (``--kv-cache-dtype auto``); another value is refused;
- refused: anything else, one line naming the flag and the nearest flag we have, exit 2.
"""
from __future__ import annotations

import difflib
import sys
from collections.abc import Collection
from dataclasses import dataclass

from epd.config import ConfigError


@dataclass(frozen=True)
class Accepted:
    """A vLLM flag taken and dropped. ``takes_value``: it has a value to drop too; ``values``: the
    values it is accepted at (empty: any), each other value refused with ``otherwise``."""

    why: str
    takes_value: bool = False
    values: tuple[str, ...] = ()
    otherwise: str = ""


@dataclass(frozen=True)
class Refused:
    why: str
    nearest: str = ""


_ONE_TOKENIZER = "the tokenizer is the checkpoint's own, at the model's --revision"
VLLM_FLAGS: dict[str, Accepted | Refused] = {
    "--trust-remote-code": Accepted("the model families served here are implemented here: no code from the "
                                    "checkpoint runs"),
    "--no-trust-remote-code": Accepted("no code from the checkpoint runs here in any case"),
    "--disable-log-requests": Accepted("requests are logged only with --enable-log-requests"),
    "--max-log-len": Accepted("requests are not logged here", takes_value=True),
    "--disable-uvicorn-access-log": Accepted("the router's HTTP server writes no access log"),
    "--disable-frontend-multiprocessing": Accepted("the router is one process"),
    "--disable-fastapi-docs": Accepted("no API docs pages are served"),
    "--disable-custom-all-reduce": Accepted("tensor-parallel ranks all-reduce through torch.distributed only"),
    "--disable-sliding-window": Accepted("the served families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) attend to the "
                                         "whole context"),
    "--enable-chunked-prefill": Accepted("prefill is always chunked (--max-num-batched-tokens a step)"),
    "--enable-auto-tool-choice": Accepted("tool calls are parsed from every answer to a request with tools"),
    "--max-parallel-loading-workers": Accepted("weights load lazily, one tensor slice at a time", takes_value=True),
    "--swap-space": Accepted("a preempted request is recomputed, never swapped (decode never preempts)",
                             takes_value=True),
    "--use-tqdm-on-load": Accepted("weight loading always logs a bar line per shard here"),
    "--no-use-tqdm-on-load": Accepted("weight loading always logs a bar line per shard here (a log line each)"),
    "--tool-call-parser": Accepted("Qwen's tool calls are hermes-style <tool_call> JSON, parsed here",
                                   takes_value=True, values=("hermes",),
                                   otherwise="the served families call tools in hermes style; use hermes"),
    "--load-format": Accepted("weights load from safetensors", takes_value=True, values=("auto", "safetensors"),
                              otherwise="only safetensors checkpoints load here"),
    "--config-format": Accepted("the checkpoint's config.json is read", takes_value=True, values=("auto", "hf")),
    "--tokenizer-mode": Accepted("the checkpoint's fast tokenizer is used", takes_value=True, values=("auto",)),
    "--kv-cache-dtype": Accepted("the KV cache is in the model's dtype (--dtype)", takes_value=True,
                                 values=("auto",), otherwise="no quantized KV cache: use auto (the model's dtype)"),
    "--model-impl": Accepted("the served families are implemented here", takes_value=True, values=("auto",)),
    "--task": Accepted("this server generates", takes_value=True, values=("auto", "generate")),
    "--runner": Accepted("this server generates", takes_value=True, values=("auto", "generate")),
    "--distributed-executor-backend": Accepted("tensor-parallel ranks are processes of the worker", takes_value=True,
                                               values=("mp",), otherwise="ranks are processes here (mp); "
                                               "to place workers on a Ray cluster use --launcher ray"),
    "--pipeline-parallel-size": Accepted("no pipeline parallelism: one stage", takes_value=True, values=("1",),
                                         otherwise="no pipeline parallelism here; use --tensor-parallel-size"),
    "-pp": Accepted("no pipeline parallelism: one stage", takes_value=True, values=("1",),
                    otherwise="no pipeline parallelism here; use --tensor-parallel-size"),
    "--data-parallel-size": Accepted("one engine a worker", takes_value=True, values=("1",),
                                     otherwise="replicas are workers here: --prefills N --decodes N"),
    "-dp": Accepted("one engine a worker", takes_value=True, values=("1",),
                    otherwise="replicas are workers here: --prefills N --decodes N"),
    "--scheduling-policy": Accepted("requests are served first come, first served", takes_value=True,
                                    values=("fcfs",), otherwise="only fcfs scheduling here"),
    "--cpu-offload-gb": Accepted("nothing is offloaded", takes_value=True, values=("0",),
                                 otherwise="no CPU offload of weights here"),
    "--response-role": Accepted("answers have the assistant role", takes_value=True, values=("assistant",)),
    "--chat-template-content-format": Accepted("message content is given to the template in OpenAI's form when "
                                               "it has images, as a string otherwise", takes_value=True,
                                               values=("auto",)),
    "--code-revision": Refused("no code from the checkpoint runs here"),
    "--tokenizer-revision": Refused(_ONE_TOKENIZER, "--revision"),
    "--tokenizer": Refused("the tokenizer is the checkpoint's own", "--chat-template"),
    "--quantization": Refused("quantized checkpoints are not loaded here", "--dtype"),
    "-q": Refused("quantized checkpoints are not loaded here", "--dtype"),
    "--ssl-keyfile": Refused("the router's HTTP API has no TLS of its own (terminate TLS in front of it)",
                             "--tls-cert (mutual TLS inside the cluster)"),
    "--ssl-certfile": Refused("the router's HTTP API has no TLS of its own (terminate TLS in front of it)",
                              "--tls-cert (mutual TLS inside the cluster)"),
    "--ssl-ca-certs": Refused("the router's HTTP API has no TLS of its own", "--tls-ca (mutual TLS inside the "
                              "cluster)"),
    "--enable-lora": Refused("no LoRA adapters here"),
    "--lora-modules": Refused("no LoRA adapters here"),
    "--speculative-config": Refused("no speculative decoding here"),
    "--reasoning-parser": Refused("answers are not split into reasoning and content here"),
    "--kv-transfer-config": Refused("prefill / decode disaggregation is built in", "--prefills N --decodes N"),
    "--mm-processor-cache-gb": Refused("the encoder cache is sized in bytes", "--encoder-cache-max-bytes"),
    "--max-logprobs": Refused("top_logprobs is capped at 20"),
    "--seed": Refused("there is no server-wide seed: an unseeded request draws freshly", "a request's own seed"),
}


def translate(argv: list[str], ours: Collection[str], prog: str) -> list[str]:
    """``argv`` with the accepted vLLM flags taken out (one line each on stderr); a refused or
    unknown flag is a ``ConfigError`` naming it (and the nearest of ``ours``, the option strings
    our parser takes, which pass untouched)."""
    out, i = [], 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("-") or token in ("-", "--") or _is_number(token):
            out.append(token)
            continue
        flag, eq, inline = token.partition("=")
        if flag in ours:
            out.append(token)
            continue
        rule = VLLM_FLAGS.get(flag)
        if rule is None:
            raise ConfigError(f"unrecognized argument {flag}{_nearest(flag, ours)}")
        if isinstance(rule, Refused):
            hint = f"; nearest here: {rule.nearest}" if rule.nearest else ""
            raise ConfigError(f"{flag} (vLLM's) is not supported: {rule.why}{hint}")
        value = None
        if rule.takes_value:
            if eq:
                value = inline
            elif i < len(argv):
                value, i = argv[i], i + 1
            else:
                raise ConfigError(f"{flag} expects a value")
        if rule.values and value not in rule.values:
            raise ConfigError(f"{flag} {value} (vLLM's) is not supported: {rule.otherwise or rule.why}; accepted: "
                              f"{', '.join(rule.values)}")
        shown = flag if value is None else f"{flag} {value}"
        print(f"{prog}: {shown} is vLLM's; accepted, as it is so here already: {rule.why}", file=sys.stderr, flush=True)
    return out


def _nearest(flag: str, ours: Collection[str]) -> str:
    match = difflib.get_close_matches(flag, sorted(ours), n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def table() -> str:
    """The docs page's table (docs/vllm-flags.md): every flag with a rule here."""
    lines = ["| vLLM flag | here | why / nearest |", "|---|---|---|"]
    for flag, rule in sorted(VLLM_FLAGS.items(), key=lambda kv: kv[0].lstrip("-")):
        if isinstance(rule, Accepted):
            at = f" at {' / '.join(rule.values)}" if rule.values else ""
            lines.append(f"| `{flag}` | accepted{at} | {rule.why} |")
        else:
            nearest = f"; nearest: `{rule.nearest}`" if rule.nearest else ""
            lines.append(f"| `{flag}` | refused | {rule.why}{nearest} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(), end="")
