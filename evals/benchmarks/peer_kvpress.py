"""The kvpress side of `kvarena bench parity`: a driver run by the peer's own interpreter.

kvpress is never a dependency of kvarena. `kvarena bench parity --peer-python PATH` starts
`PATH evals/benchmarks/peer_kvpress.py --model DIR --threads N` as a subprocess; this file imports
only the standard library at module level (kvarena imports it for the protocol's loop) and torch,
transformers and kvpress only inside the driver, so it runs in a venv that has kvpress and nothing
of kvarena.

Protocol: one JSON object per line. The driver answers on its original stdout and sends everything
else (transformers' and kvpress's logs) to stderr, which the harness keeps in a log file.

- On start it loads the model directory with transformers (float32, SDPA attention; an eager
  copy is loaded on first use for a press that reads attention weights) and writes
  ``{"ready": true, "info": {...}}``: the kvpress, transformers, torch and Python versions.
- ``{"op": "run", "prompt": [token ids], "press": SPEC or null, "max_new_tokens": N}`` prefills
  the whole prompt under the press (kvpress compresses the prefill's cache in a forward hook of
  every attention layer), then decodes N tokens greedily with EOS ignored, with the compressed
  cache and the tokens' true positions, and answers ``{"kept": K, "tokens": [...]}``. K is null
  without a press, else one list per layer of one list per KV head: the prompt positions that
  head kept, ascending. SPEC is ``{"name": "SnapKVPress", "args": {...}, "inner": SPEC or null,
  "attn": "sdpa" | "eager"}``: kvpress's class by its exported name, its keyword arguments, and
  for a wrapper press (AdaKVPress, ChunkKVPress) the press it wraps.
- ``{"op": "quit"}`` (or end of input) exits 0. An error answers ``{"error": "..."}`` and exits 1.

Kept positions are read, not recomputed: a press that shortens the cache returns the kept keys
gathered from the full ones, and each kept key row is found among the prefill's keys by exact
equality (a RoPE-rotated key row is unique to its position); a press that masks instead
(AdaKVPress: every key stays, the evicted ones are named in the attention module's
``masked_key_indices``) keeps the complement of what it masked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Iterable

ATTENTION = ("sdpa", "eager")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="kvpress side of `kvarena bench parity` (JSON lines on "
                                            "stdin/stdout).")
    p.add_argument("--model", required=True, help="HF-format model directory.")
    p.add_argument("--threads", type=int, required=True)
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    return args


def versions() -> dict:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for dist in ("kvpress", "transformers", "torch"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


# ----------------------------------------------------------------------------------------------
# kept positions


def kept_positions(keys, kept_keys, masked=None) -> list[list[int]]:
    """The positions each KV head kept, ascending: `[kv_heads][n_h]`.

    keys: the prefill's keys `[1, kv_heads, T, head_dim]`; kept_keys: what the press left
    `[1, kv_heads, n, head_dim]` (rows gathered from `keys`, in any order); masked: a masking
    press's `(batch, head, position)` index tensors of the evicted keys, or None. Raises
    ValueError when a kept row matches no prefill row or several (the positions would be a guess).
    """
    import torch

    if keys.shape[0] != 1 or kept_keys.shape[0] != 1:
        raise ValueError(f"batch 1 only, got keys {tuple(keys.shape)}, kept {tuple(kept_keys.shape)}")
    heads, length = keys.shape[1], keys.shape[2]
    if masked is not None:
        _batch, head_idx, pos_idx = masked
        keep = torch.ones(heads, length, dtype=torch.bool)
        keep[head_idx.cpu().long(), pos_idx.cpu().long()] = False
        return [keep[h].nonzero().flatten().tolist() for h in range(heads)]
    out = []
    for h in range(heads):
        same = (kept_keys[0, h][:, None, :] == keys[0, h][None, :, :]).all(dim=-1)  # [n, T]
        matches = same.sum(dim=-1)
        if bool((matches != 1).any()):
            row = int((matches != 1).nonzero()[0])
            raise ValueError(f"kept key {row} of head {h} matches {int(matches[row])} prefill "
                             f"positions; cannot tell which position it is")
        out.append(sorted(same.float().argmax(dim=-1).tolist()))
    return out


# ----------------------------------------------------------------------------------------------
# the driver


def build_press(spec: dict):
    """A kvpress press from its JSON spec (module docstring)."""
    import kvpress

    unknown = set(spec) - {"name", "args", "inner", "attn"}
    if unknown:
        raise ValueError(f"unknown press spec keys {sorted(unknown)}")
    name = spec.get("name")
    cls = getattr(kvpress, str(name), None)
    if not isinstance(cls, type) or not issubclass(cls, kvpress.BasePress):
        raise ValueError(f"kvpress has no press named {name!r}")
    args = dict(spec.get("args") or {})
    if spec.get("inner") is not None:
        args["press"] = build_press(spec["inner"])
    return cls(**args)


class Driver:
    """transformers' model with kvpress's hooks: one greedy run per request.

    model_dir: the HF-format directory; threads: torch's threads; presses: import kvpress now
    (False: runs without a press only, for a stand-in driver that reads no press)."""

    def __init__(self, model_dir: str, threads: int, presses: bool = True) -> None:
        import torch
        import transformers

        if presses:
            import kvpress  # noqa: F401  (patches transformers' attention for AdaKVPress's masks)
        transformers.utils.logging.disable_progress_bar()  # no bars in the log's last lines
        torch.set_num_threads(threads)
        self.model_dir = model_dir
        self.models: dict[str, object] = {}
        self.model("sdpa")

    def model(self, attn: str):
        if attn not in ATTENTION:
            raise ValueError(f"attention must be one of {list(ATTENTION)}, got {attn!r}")
        if attn not in self.models:
            import torch
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32,
                                                         attn_implementation=attn)
            self.models[attn] = model.eval()
        return self.models[attn]

    def info(self) -> dict:
        return versions()

    def run(self, prompt: list[int], spec: dict | None, max_new_tokens: int) -> dict:
        import contextlib

        import torch
        from transformers import DynamicCache

        if not prompt or max_new_tokens < 1:
            raise ValueError(f"a run needs a prompt and max_new_tokens >= 1, got {len(prompt)} "
                             f"tokens and {max_new_tokens}")
        model = self.model((spec or {}).get("attn", "sdpa"))
        press = build_press(spec) if spec is not None else None
        kept: dict[int, list[list[int]]] = {}
        if press is not None:
            record(press, kept)
        start = time.perf_counter()
        with torch.inference_mode():
            cache = DynamicCache()
            ids = torch.tensor([prompt])
            with press(model) if press is not None else contextlib.nullcontext():
                out = model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
            token = out.logits[0, -1].argmax()
            tokens = [int(token)]
            for i in range(max_new_tokens - 1):
                out = model(input_ids=token.view(1, 1), past_key_values=cache,
                            position_ids=torch.tensor([[len(prompt) + i]]))
                token = out.logits[0, -1].argmax()
                tokens.append(int(token))
        layers = model.config.num_hidden_layers
        if press is not None and sorted(kept) != list(range(layers)):
            raise RuntimeError(f"the press compressed layers {sorted(kept)}, expected all {layers}")
        return {"kept": [kept[i] for i in range(layers)] if press is not None else None,
                "tokens": tokens, "seconds": time.perf_counter() - start}


def record(press, kept: dict) -> None:
    """Make `press` write each layer's kept positions into `kept[layer]` as it compresses.

    The press's forward hook calls `self.compress`; an instance attribute of that name wraps the
    class's method without changing what it returns."""
    original = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        module.masked_key_indices = None
        new_keys, new_values = original(module, hidden_states, keys, values, attentions, kwargs)
        kept[module.layer_idx] = kept_positions(keys, new_keys,
                                                getattr(module, "masked_key_indices", None))
        return new_keys, new_values

    press.compress = compress


# ----------------------------------------------------------------------------------------------
# the protocol


def serve(make_driver: Callable[[], object], lines: Iterable[str],
          answer: Callable[[dict], None]) -> int:
    """The protocol's loop (module docstring): `make_driver()` builds the driver (info(), run()),
    `lines` are the requests, `answer` writes one reply. Returns the exit status."""
    try:
        driver = make_driver()
        answer({"ready": True, "info": driver.info()})
        for line in lines:
            if not line.strip():
                continue
            cmd = json.loads(line)
            op = cmd.get("op")
            if op == "quit":
                break
            if op != "run":
                raise ValueError(f"unknown op {op!r}; valid: run, quit")
            answer(driver.run(cmd["prompt"], cmd.get("press"), int(cmd["max_new_tokens"])))
    except Exception as exc:
        answer({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    return 0


def protocol_streams() -> Callable[[dict], None]:
    """Answers go to the original stdout; anything printed later (libraries' logs) to stderr."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def answer(obj: dict) -> None:
        answers.write(json.dumps(obj) + "\n")

    return answer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    answer = protocol_streams()
    return serve(lambda: Driver(args.model, args.threads), sys.stdin, answer)


if __name__ == "__main__":
    # Run as a script, this file's folder comes first on sys.path, and its siblings (kernels.py,
    # common.py, memory.py, ...) would shadow the packages of those names that transformers looks
    # for (it probes for a `kernels` package).
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    sys.exit(main())
