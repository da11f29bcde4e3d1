#!/usr/bin/env bash
# One prepared GPU run (issue 24): every GPU figure as JSON, within 8 minutes on one H200, offline.
#
#   bash scripts/gpu_check.sh                 # in the repository root of a checkout; figures in $OUT or ./gpu_out
#   GPU_CHECK_DRY=1 bash scripts/gpu_check.sh # the same plumbing on CPU at tiny sizes (< 1 minute): no GPU figure
#
# Parts, in order of value, each under its own timeout and all under one deadline (GPU_CHECK_BUDGET_S, default
# 450 s): a part that fails or times out is recorded and the next one runs; a part that no longer fits the
# deadline is recorded as skipped. The script always exits 0; summary.json says what ran, how, and what it gave.
#
#   install   only what is missing: the repository (pip install --no-deps -e ., no index), and packages whose
#             wheels travel with the checkout in wheels/ (ignored by git; pip --no-index --find-links wheels,
#             torch pinned to the installed build, never reinstalled); what is still missing -> install_notes.txt
#   env       python, torch, CUDA, GPU, optional kernels (flash-attn, liger-kernel, torchvision) -> env.json
#   demo      the procedural demo dataset, when data/demo is missing (what the benchmark trains on)
#   pytest    python -m pytest -m gpu -> pytest_gpu.txt, pytest_gpu.xml
#   decode    scripts/benchmark.py --sections decode: JPEG decode in a worker (Pillow) vs on the GPU (nvJPEG, batched
#             per pack, data.image_decode=device), images/s and host CPU per image -> decode.json / .md
#   train_*   scripts/benchmark.py --sections train on configs/model_460m.yaml and model_222m.yaml at T = 16384 and
#             8192: "eager" runs time packed vs pad-to-longest (torch_varlen; sdpa and flash_attn beside it at
#             8192), "step" runs time packed vs static packs eager vs the compiled step with and without CUDA
#             graphs, the "liger" run the fused loss (when liger-kernel is installed), with MFU, peak memory and
#             host vs device time per step -> train_<run>.json / .md
#   summary   summary.json (every part, headline figures) and summary.md (one markdown table of them)
#
# Knobs (environment): OUT, GPU_CHECK_BUDGET_S, GPU_CHECK_REPS (3), GPU_CHECK_RUNS (the runs to do, in that order,
# comma-separated names from RUNS below; default all), GPU_CHECK_BENCH_ARGS (extra benchmark arguments, e.g.
# "--data DIR --tokenizer DIR"), GPU_CHECK_PYTEST (1; 0 skips pytest, e.g. in a second call), PYTHON (python).
# Documented in docs/performance.md ("One prepared GPU run").
set -u

cd "$(dirname "$0")/.." || exit 0
ROOT=$PWD
OUT_DIR=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT_DIR" || exit 0
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOG=$OUT_DIR/gpu_check.log
PARTS=$OUT_DIR/parts.jsonl
: >"$PARTS"
exec > >(tee -a "$LOG") 2>&1

PY=${PYTHON:-python}
DRY=${GPU_CHECK_DRY:-0}
BUDGET_S=${GPU_CHECK_BUDGET_S:-450}
REPS=${GPU_CHECK_REPS:-3}
KEEP_RUNS=${GPU_CHECK_RUNS:-}
BENCH_ARGS=${GPU_CHECK_BENCH_ARGS:-}
RESERVE_S=15   # kept for the summary
MIN_PART_S=20  # a part with less time than this left is skipped, not started
START=$(date +%s)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

echo "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) in $ROOT -> $OUT_DIR (budget ${BUDGET_S}s, dry=$DRY)"

# record NAME STATUS RC WALL_S CAP_S NOTE [COMMAND...]: one JSON line in parts.jsonl (python's json escapes)
record() {
  "$PY" - "$@" >>"$PARTS" <<'EOF'
import json, sys
name, status, rc, wall, cap, note, *cmd = sys.argv[1:]
print(json.dumps({"part": name, "status": status, "rc": int(rc), "wall_s": int(wall), "cap_s": int(cap),
                  "note": note, "command": " ".join(cmd)}))
EOF
}

# run_part NAME CAP_S COMMAND...: run under min(CAP_S, time left) seconds; output to NAME.txt and the log
run_part() {
  local name=$1 cap=$2 left t0 rc status wall note
  shift 2
  left=$((BUDGET_S - ($(date +%s) - START) - RESERVE_S))
  if ((left < MIN_PART_S)); then
    echo "== $name: skipped, ${left}s left of the budget"
    record "$name" skipped -1 0 "$cap" "out of time budget (${left}s left)" "$@"
    return 0
  fi
  ((cap > left)) && cap=$left
  echo "== $name (timeout ${cap}s): $*"
  t0=$(date +%s)
  timeout --kill-after=10 "$cap" "$@" 2>&1 | tee "$OUT_DIR/$name.txt"
  rc=${PIPESTATUS[0]}
  wall=$(($(date +%s) - t0))
  note=""
  case $rc in
    0) status=ok ;;
    124 | 137) status=timeout note="killed after ${cap}s" ;;
    *) status=failed note=$(tail -n 3 "$OUT_DIR/$name.txt" | tr '\n' ' ' | cut -c1-400) ;;
  esac
  echo "== $name: $status (rc $rc, ${wall}s)"
  record "$name" "$status" "$rc" "$wall" "$cap" "$note" "$@"
  return 0
}

# ---------------------------------------------------------------------------------------------------------------
# install: only what is missing, only from what travels with the checkout (no registry on that machine)

install_missing() {
  local notes=() torch_version missing dist
  shopt -s nocaseglob # wheel names: Pillow-..., pillow-...
  torch_version=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null)
  if [[ -n $torch_version ]]; then
    echo "torch==$torch_version" >"$OUT_DIR/constraints.txt" # pip may not replace the image's CUDA build
  else
    : >"$OUT_DIR/constraints.txt"
    notes+=("torch is not importable: nothing GPU can run")
  fi
  if ! "$PY" -c "import nanovlm" 2>/dev/null; then
    echo "-- nanovlm is not importable: pip install --no-deps -e . (no index, no build isolation)"
    "$PY" -m pip install --no-deps --no-index --no-build-isolation -e . || notes+=("pip install -e . failed")
  fi
  if ! "$PY" -c "import nanovlm" 2>/dev/null; then # e.g. no setuptools to build with: run from the checkout
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
    notes+=("nanovlm imported from the checkout (PYTHONPATH)")
  fi
  # the project's runtime dependencies (pyproject.toml) and pytest: installed, or from wheels/, or reported
  missing=$("$PY" - <<'EOF'
import re
from importlib import metadata
try:
    import tomllib
    deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
except Exception:  # Python < 3.11: the names only
    text = open("pyproject.toml").read().split("dependencies = [", 1)[1].split("]", 1)[0]
    deps = re.findall(r'"([^"]+)"', text)
for req in [*deps, "pytest"]:
    name = re.split(r"[<>=!~ \[;]", req, maxsplit=1)[0]
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        print(name)
EOF
  )
  for dist in $missing flash-attn liger-kernel torchvision; do
    case $dist in
      torchvision) "$PY" -c "import torchvision.io" 2>/dev/null && continue ;;
      flash-attn) "$PY" -c "import flash_attn" 2>/dev/null && continue ;;
      liger-kernel) "$PY" -c "import liger_kernel" 2>/dev/null && continue ;;
    esac
    if compgen -G "wheels/${dist//-/_}-*" >/dev/null || compgen -G "wheels/${dist}-*" >/dev/null; then
      echo "-- installing $dist from wheels/"
      "$PY" -m pip install --no-index --find-links wheels -c "$OUT_DIR/constraints.txt" "$dist" ||
        "$PY" -m pip install --no-index --find-links wheels --no-deps "$dist" ||
        notes+=("$dist: install from wheels/ failed")
    else
      notes+=("$dist: missing and not in wheels/")
    fi
  done
  printf '%s\n' "${notes[@]}" >"$OUT_DIR/install_notes.txt"
  echo "-- install notes:"
  cat "$OUT_DIR/install_notes.txt"
  return 0
}

t0=$(date +%s)
install_missing 2>&1 | tee "$OUT_DIR/install.txt"
record install ok 0 $(($(date +%s) - t0)) 0 "$(paste -sd ';' "$OUT_DIR/install_notes.txt" 2>/dev/null)"
"$PY" -c "import nanovlm" 2>/dev/null || export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} # the subshell's export

# ---------------------------------------------------------------------------------------------------------------
# env: what this machine has after the install (nothing here may fail the script)

"$PY" - "$OUT_DIR/env.json" <<'EOF'
import importlib, json, platform, subprocess, sys
env = {"python": platform.python_version(), "executable": sys.executable}
try:
    import torch
    env.update(torch=torch.__version__, cuda_build=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = {"name": p.name, "memory_gb": round(p.total_memory / 1e9, 1),
                      "capability": list(torch.cuda.get_device_capability(0)), "count": torch.cuda.device_count()}
except Exception as e:
    env["torch_error"] = f"{type(e).__name__}: {e}"
for mod in ("flash_attn", "liger_kernel", "torchvision", "triton", "nanovlm", "lightning", "transformers", "webdataset", "pytest"):
    try:
        m = importlib.import_module(mod)
        env[mod] = getattr(m, "__version__", "present")
    except Exception as e:
        env[mod] = f"missing ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
try:
    smi = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm", "--format=csv,noheader"]
    env["nvidia_smi"] = subprocess.run(smi, capture_output=True, text=True, timeout=20).stdout.strip()
except Exception as e:
    env["nvidia_smi"] = f"unavailable ({type(e).__name__})"
print(json.dumps(env, indent=1))
with open(sys.argv[1], "w") as f:
    json.dump(env, f, indent=1)
EOF

# ---------------------------------------------------------------------------------------------------------------
# demo data, then the gpu tests

if [[ ! -d data/demo/train && $BENCH_ARGS != *--data* ]]; then
  run_part demo 90 "$PY" -c "from nanovlm.config import load_config; from nanovlm.train.run import ensure_data
ensure_data(load_config(['tiny_cpu.yaml'], []))"
fi

TESTS=() # all of tests/ (what `-m gpu` selects); dry: the GPU test file only, to skip collecting the rest
[[ $DRY == 1 ]] && TESTS=(tests/integration/test_gpu.py)
if [[ ${GPU_CHECK_PYTEST:-1} == 1 ]]; then
  run_part pytest_gpu 120 "$PY" -m pytest -m gpu -q -p no:cacheprovider -rfEs --junitxml "$OUT_DIR/pytest_gpu.xml" \
    "${TESTS[@]}"
else
  record pytest_gpu skipped -1 0 0 "GPU_CHECK_PYTEST=0"
fi

DEC_ARGS=(--device cuda --reps "$REPS")
[[ $DRY == 1 ]] && DEC_ARGS=(--device cpu --quick --reps 1)
run_part decode 60 "$PY" scripts/benchmark.py --sections decode "${DEC_ARGS[@]}" --json "$OUT_DIR/decode.json" \
  --markdown "$OUT_DIR/decode.md"

# ---------------------------------------------------------------------------------------------------------------
# the train benchmark: name preset T kind samples timeout_s (samples: about 3 packs of T per pass of the demo data)

if [[ $DRY == 1 ]]; then # CPU, the small config, tiny sizes: the same commands and outputs, no GPU figure
  DEVICE=cpu
  RUNS=("dry_eager - 512 eager 40 60" "dry_step - 512 step 40 90")
  SIZE_ARGS=(--set model.language.num_layers=1 --set model.vision.num_layers=1 --compile-backend aot_eager)
else
  DEVICE=cuda
  RUNS=( # in order of value: the deadline cuts from the end
    "222m_8k_eager model_222m.yaml 8192 eager 300 80"
    "460m_16k_eager model_460m.yaml 16384 eager 480 100"
    "460m_16k_step model_460m.yaml 16384 step 480 240"
    "222m_8k_step model_222m.yaml 8192 step 300 190"
    "222m_8k_liger model_222m.yaml 8192 liger 300 60"
    "222m_16k_eager model_222m.yaml 16384 eager 600 90"
    "460m_8k_eager model_460m.yaml 8192 eager 250 90"
    "222m_16k_step model_222m.yaml 16384 step 600 190"
    "460m_8k_step model_460m.yaml 8192 step 250 190"
  )
  # one factor at a time: torch_varlen and the PyTorch loss everywhere, except the row that compares each
  SIZE_ARGS=(--set model.attn_backend=torch_varlen --set model.loss_kernel=torch)
fi

if [[ -n $KEEP_RUNS ]]; then # the runs named, in the order named
  picked=()
  IFS=, read -ra wanted <<<"$KEEP_RUNS"
  for want in "${wanted[@]}"; do
    for spec in "${RUNS[@]}"; do [[ ${spec%% *} == "$want" ]] && picked+=("$spec"); done
  done
  RUNS=("${picked[@]}")
fi

for spec in "${RUNS[@]}"; do
  read -r name preset T kind samples cap <<<"$spec"
  cmd=("$PY" scripts/benchmark.py --sections train --device "$DEVICE" --budget "$T" --train-samples "$samples")
  cmd+=(--reps "$REPS" --json "$OUT_DIR/train_$name.json" --markdown "$OUT_DIR/train_$name.md" "${SIZE_ARGS[@]}")
  [[ $preset != - ]] && cmd+=(--preset "$preset")
  ((T > 8192)) && cmd+=(--set "model.language.max_position_embeddings=$T") # the presets stop at 8192
  case $kind in
    eager) # packed vs pad-to-longest; the attention backends beside torch_varlen at 8192
      cmd+=(--train-modes "packed,pad_to_longest")
      if ((T <= 8192)); then cmd+=(--backends "sdpa,flash_attn"); else cmd+=(--backends none); fi
      ;;
    step) # packed vs static packs eager vs the compiled step, with and without CUDA graphs
      cmd+=(--train-modes packed --compile-step --backends none) ;;
    liger) # the fused loss: this packed row against the eager run's packed row (PyTorch's chunked loss)
      if ! "$PY" -c "import liger_kernel" 2>/dev/null; then
        record "train_$name" skipped -1 0 "$cap" "liger-kernel is not installed (wheels/ had none)"
        continue
      fi
      cmd+=(--train-modes packed --backends none --set model.loss_kernel=liger) ;;
  esac
  # shellcheck disable=SC2206 # word splitting of the extra arguments is intended
  cmd+=($BENCH_ARGS)
  run_part "train_$name" "$cap" "${cmd[@]}"
done

# ---------------------------------------------------------------------------------------------------------------
# summary: every part, and the headline figures of each train run (the full ones are in train_<run>.json)

"$PY" - "$OUT_DIR" "$(($(date +%s) - START))" <<'EOF'
import json, sys
from pathlib import Path
out, wall = Path(sys.argv[1]), int(sys.argv[2])
parts = [json.loads(line) for line in (out / "parts.jsonl").read_text().splitlines() if line.strip()]
def row(name, r):
    """The headline figures of one row of a train run."""
    if "unavailable" in r:
        return {"row": name, "unavailable": r["unavailable"]}
    keep = ("fill", "step_ms_median", "peak_memory_mb", "mfu", "host_issue_ms_median", "first_step_s", "error")
    fig = {k: r[k] for k in keep if k in r}
    if "real_tokens_per_s" in r:
        fig["real_tokens_per_s"] = r["real_tokens_per_s"]["median"]
    if r.get("profile"):
        fig["host_ms"], fig["device_ms"] = r["profile"]["host_ms"], r["profile"]["device_ms"]
    if r.get("first_losses"):
        fig["first_loss"] = r["first_losses"][0]
    if r.get("compile_counters"):
        fig["compile_counters"] = r["compile_counters"]
    return {"row": name, **fig}
train = {}
for p in parts:
    if not p["part"].startswith("train_"):
        continue
    f = out / f"{p['part']}.json"
    if not f.exists():
        train[p["part"]] = {"status": p["status"], "note": p["note"] or "no JSON written"}
        continue
    sec = json.loads(f.read_text())["sections"]["train"]
    rows = [row(n, r) for n, r in sec["modes"].items()] + [row(f"packed/{b['backend']}", b) for b in sec["backends"]]
    ratio = {k: (sec["ratio_check"] or {}).get(k) for k in ("actual_ratio", "ideal_ratio", "fraction_of_ideal")}
    train[p["part"]] = {"status": p["status"], "layout": sec["layout"], "rows": rows, "packed_over_padded": ratio}
def pytest_counts(path):
    """Counts and the failing tests of the junit file (None when pytest did not finish)."""
    if not path.exists():
        return None
    import xml.etree.ElementTree as ET
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    bad = [f"{c.get('classname')}::{c.get('name')}: {(x.get('message') or '')[:200]}" for c in suite.iter("testcase")
           for x in c if x.tag in ("failure", "error")]
    return {**counts, "failed": bad}
def section(name):
    """A benchmark JSON's section, or None when that part wrote none."""
    f = out / f"{name}.json"
    return json.loads(f.read_text())["sections"][name] if f.exists() else None
summary = {"wall_s": wall, "parts": parts, "pytest_gpu": pytest_counts(out / "pytest_gpu.xml"), "train": train,
           "decode": section("decode"),
           "env": json.loads((out / "env.json").read_text()) if (out / "env.json").exists() else None}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(f"== summary ({wall}s) -> {out / 'summary.json'}")
for p in parts:
    print(f"  {p['part']:<22} {p['status']:<8} {p['wall_s']:>4}s  {p['note']}")
print(f"  pytest -m gpu: {summary['pytest_gpu']}")
for r in (summary["decode"] or {}).get("rows", []):
    print(f"  decode {r['path']:<8} images/s {r['images_per_s']:.0f}  host CPU ms/image {r['host_cpu_ms_per_image']:.2f}")
def fmt(x, scale=1.0):
    return "-" if x is None else f"{x * scale:.1f}"
for name, t in train.items():
    for r in t.get("rows", []):
        print(f"  {name:<22} {r['row']:<28} tokens/s {fmt(r.get('real_tokens_per_s'))}  step ms "
              f"{fmt(r.get('step_ms_median'))}  MFU% {fmt(r.get('mfu'), 100)}  host/device ms "
              f"{fmt(r.get('host_ms'))}/{fmt(r.get('device_ms'))}  {r.get('error') or r.get('unavailable') or ''}")
# summary.md: the same figures as one markdown table (what the README's GPU table is made from)
gpu = (summary["env"] or {}).get("gpu", {}).get("name", "no GPU")
md = [f"GPU: {gpu}; `bash scripts/gpu_check.sh` ({wall} s). Per run: packed over pad-to-longest real tokens/s and "
      "the share of the ideal (the ratio of their fills).", "",
      "| run | row | real tokens/s | step ms | MFU | peak MB | host / device ms per step |", "|---|---|---|---|---|---|---|"]
for name, t in train.items():
    for r in t.get("rows", []):
        note = r.get("error") or r.get("unavailable")
        cells = [fmt(r.get("real_tokens_per_s")), fmt(r.get("step_ms_median")), fmt(r.get("mfu"), 100) + ("%" if r.get("mfu") else ""),
                 fmt(r.get("peak_memory_mb")), f"{fmt(r.get('host_ms'))} / {fmt(r.get('device_ms'))}"]
        md.append(f"| {name[6:]} | {r['row']} | " + (f"{note} | | | | |" if note else " | ".join(cells) + " |"))
    ratio = t.get("packed_over_padded") or {}
    if ratio.get("actual_ratio") is not None:
        md.append(f"| {name[6:]} | packed / padded | {ratio['actual_ratio']:.2f}x of {ratio['ideal_ratio']:.2f}x "
                  f"({100 * ratio['fraction_of_ideal']:.0f}%) | | | | |")
for r in (summary["decode"] or {}).get("rows", []):
    md.append(f"| decode | JPEG, {r['path']} | {r['images_per_s']:.0f} images/s | | | | "
              f"{r['host_cpu_ms_per_image']:.2f} host CPU ms/image |")
(out / "summary.md").write_text("\n".join(md) + "\n")
EOF
echo "== gpu_check done in $(($(date +%s) - START))s; log $LOG"
exit 0
