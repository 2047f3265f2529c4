#!/usr/bin/env bash
# The GPU runs behind docs/benchmarks.md and docs/training.md, stage by stage, on an H200 host
# (2 GPUs for the scaling stages). Wheels the image lacks are installed from .whl/ (see bench/README.md).
#   bash bench/h200_session.sh STAGE [ARGS], one stage a call; each stage's comment below says what it runs:
#   setup (install, versions, GPU tests first on a fresh host); training: train_bench_1, train_bench_2, after_1gpu,
#   scaling, balance_x2 (2 GPUs), levers, gaps, sft_hostsync, patch_embed, vision_compile; data: prep_bench;
#   evaluation: eval_bench, validate_1gpu; rollouts: rollout_bench, closed_loop_1gpu, rollout_phases,
#   decoder_candidates; GRPO: grpo, grpo_phases, agent_1gpu, agent_seeds [FIELD=VALUE ...].
#   rollout_phases, grpo_phases and decoder_candidates time a base commit's tree beside the checkout: first, here,
#   mkdir .before; git archive BASE eogym_sft bench recipes | tar -x -C .before (git-ignored: carry .before).
set -euo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
cfg=recipes/configs/qwen3_vl_4b_instruct.json
model=/tmp/qwen3vl4b-random
data=/tmp/eo_synth
bench="--rows 160 --steps 6 --warmup 2 --grad-accum 2 --workdir /tmp/bt"
# the GPU agent study's AgentDemoConfig settings (docs/rl.md#five-seeds-on-one-h200), for agent_seeds and agent_1gpu
agent_gpu="train_rows=384 held_out_rows=128 samples=4 sft_steps=60 grpo_steps=240 grpo_questions_per_step=2 num_generations=8
  grpo_learning_rate=2e-4 grpo_num_iterations=2 grpo_disable_dropout=true grpo_epsilon_high=0.28 rft_steps=0
  val_rows=32 sft_pick_every=20 grpo_pick_every=0 held_out_base=false"

make_model() { [ -f $model/config.json ] || python -m eogym_sft.cli tiny-model --config $cfg --dtype bfloat16 --device cuda --output $model; }
make_adapters() {  # two random rank-16 adapters of the recipe's targets, lora_B from N(0, 0.02), seeds 1 and 2: /tmp/cl_adapters/{a,b}
  [ -f /tmp/cl_adapters/b/adapter_config.json ] || python -c "
from eogym_sft.models.loading import apply_lora, load_base_model
import torch
model = apply_lora(load_base_model('$model', 'bfloat16'))
for name, seed in (('a', 1), ('b', 2)):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if 'lora_B' in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    model.save_pretrained('/tmp/cl_adapters/' + name)
print('adapters a, b written')"
}
make_bench_data() {  # the benches' /tmp/bt sample (220 rows, prepared), without building arm B's model
  [ -f /tmp/bt/prepared/stats.json ] || python -c "
import sys; from pathlib import Path; sys.path.insert(0, 'bench')
import train_throughput as t
from eogym_sft.models.tiny import build_offline_processor
work = Path('/tmp/bt'); proc = work / 'processor'; build_offline_processor().save_pretrained(proc)
(proc / 'config.json').write_text(Path('$cfg').read_text()); t.prepare_data(work, 220, proc)" > /tmp/bench_data.log 2>&1 || { tail -5 /tmp/bench_data.log; exit 1; }
}
lever_arms() {  # a lever's arms against its baseline in one process: STAGE ARMS TIMED_STEPS LIMIT_S [WARM-UP STEPS, 1]
  make_bench_data
  timeout $(($4 - SECONDS)) python bench/train_throughput.py --rows 220 --warmup ${5:-1} --steps $3 --grad-accum 32 \
    --workdir /tmp/bt --parity-samples 0 --arms $2 --json $OUT/$1_arms.json > $OUT/$1_arms.log 2>&1 || echo "arms: exit $?"
  grep -vE "Warning|warn" $OUT/$1_arms.log | tail -4
}
make_data() { [ -f $data/train.jsonl ] || python -c "import sys; sys.path.insert(0, 'bench'); from common import generate_sample; generate_sample('$data', rows=${1:-240}, seed=0)"; }

case "$1" in
setup)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch, transformers, trl, peft, accelerate, deepspeed, datasets; print({m.__name__: m.__version__ for m in (torch, transformers, trl, peft, accelerate, deepspeed, datasets)}, torch.version.cuda)"
  python -m pytest -q -p no:cacheprovider -o addopts="" tests/models/test_attention.py tests/data/test_collator.py tests/agent/test_decoder.py tests/agent/test_cuda_graphs.py tests/agent/test_merged_lora.py tests/agent/test_image_inputs.py tests/agent/test_text_norms.py tests/agent/test_sampling.py 2>&1 | tail -5 || echo "GPU tests failed"
  ;;
train_bench_1)
  CUDA_VISIBLE_DEVICES=0 python bench/train_throughput.py $bench --arms A,B,B-b1,B-b1-GC,B-GC --json $OUT/train_1gpu_part1.json
  ;;
train_bench_2)
  CUDA_VISIBLE_DEVICES=0 python bench/train_throughput.py $bench --arms B,B-nocompile,B-fixedcount,A,B-dropout0,B-padded --parity-samples 0 --json $OUT/train_1gpu_part2.json
  ;;
prep_bench)
  # the target: EO-Gym's 7,642-row train split in under 60 s on 16 cores, every image checked to its end
  python bench/prep_throughput.py --rows 7642 --num-proc 16 --json $OUT/prep_7642_16c.json
  ;;
scaling)
  CUDA_VISIBLE_DEVICES=0 python bench/train_throughput.py $bench --arms B --json $OUT/scale_1gpu.json
  accelerate launch --config_file recipes/accelerate/ddp.yaml --num_processes 2 bench/train_throughput.py $bench --arms B --json $OUT/scale_ddp.json
  accelerate launch --config_file recipes/accelerate/deepspeed_zero2.yaml --num_processes 2 bench/train_throughput.py $bench --arms B --json $OUT/scale_zero2.json
  ;;
eval_bench)
  make_model; make_data 240
  CUDA_VISIBLE_DEVICES=0 python bench/eval_throughput.py --model $model --rows 16 --batch-size 16 --max-new-tokens 64 --json $OUT/eval.json
  ;;
balance_x2)
  # 2 GPUs, ZeRO-2: token-balanced (B) against fixed-count (B-fixedcount) micro-batches, 64-sample steps of 16
  # micro-batches of 2 a GPU, 1 warm-up and 3 timed steps each
  make_bench_data
  timeout $((585 - SECONDS)) accelerate launch --config_file recipes/accelerate/deepspeed_zero2.yaml --num_processes 2 \
    bench/train_throughput.py --rows 220 --warmup 1 --steps 3 --grad-accum 16 --workdir /tmp/bt --parity-samples 0 \
    --arms B,B-fixedcount --json $OUT/balance_x2.json > $OUT/balance_x2.log 2>&1 || echo "balance_x2: exit $?"
  grep -vE "Warning|warn" $OUT/balance_x2.log | tail -6
  ;;
after_1gpu)
  # the headline: plain TRL (A) and B in one process on one GPU, 1 warm-up + 4 timed steps each (B at the recipe's 32
  # micro-batches), B profiled over one more step with its trace (trace_B.json.gz)
  make_bench_data; mkdir -p /tmp/logs
  timeout $((560 - SECONDS)) python bench/train_throughput.py --rows 220 --warmup 1 --steps 4 --grad-accum 32 \
    --workdir /tmp/bt --parity-samples 0 --arms A,B --profile B --trace $OUT/trace_ARM.json.gz \
    --json $OUT/after.json > /tmp/logs/after.log 2>&1 || echo "after: exit $?"
  grep -vE "Warning|warn" /tmp/logs/after.log | tail -4
  ;;
rollout_bench)
  make_model
  CUDA_VISIBLE_DEVICES=0 python bench/rollout_throughput.py --model $model --episodes 48 --serial-episodes 1 --concurrency 32 \
    --turns 3 --new-tokens 128 --cuda-graphs --workdir /tmp/rb --json $OUT/rollout.json
  ;;
grpo)
  # one step of the seed's scale (2 questions x 8 episodes, 4-7 images of 1000 px, 2 forced crop turns of 96 tokens
  # then an answer) on TRL's loop and on the slot decoder, then the recipe's own defaults for one step; the
  # CUDA-graph test of the decoder first
  [ -d /tmp/site/trl ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  make_model
  python -m pytest -q -p no:cacheprovider -o addopts="" tests/training/test_grpo_slots.py -k cuda_graphs 2>&1 | tail -3 || echo "grpo GPU test failed"
  CUDA_VISIBLE_DEVICES=0 timeout 480 python bench/grpo_step.py --model $model --arms trl,slots,recipe --questions 2 --generations 8 \
    --images 4-7 --image-px 1000 --calls 2 --call-tokens 96 --steps 1 --warmup 1 --workdir /tmp/grpo_bench \
    --json $OUT/grpo_engines.json > $OUT/grpo_engines.log 2>&1 || echo "grpo: exit $?"
  grep -E "^step |^arm|^trl|^slots|^recipe|Error|error" $OUT/grpo_engines.log | tail -30
  ;;
closed_loop_1gpu)
  make_model; make_data 48
  python -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/agent/test_decoder.py tests/agent/test_cuda_graphs.py tests/agent/test_merged_lora.py tests/agent/test_image_inputs.py tests/agent/test_text_norms.py tests/agent/test_sampling.py 2>&1 | tail -3 || echo "closed_loop GPU tests failed"
  make_adapters
  for graphs in --cuda-graphs --no-cuda-graphs; do
    CUDA_VISIBLE_DEVICES=0 timeout 150 python -m eogym_sft.cli rollout --model $model --adapter a=/tmp/cl_adapters/a b=/tmp/cl_adapters/b \
      --data $data/train.jsonl --data-root $data/data --tools crop,replay --samples 1 --temperature 0 --max-turns 3 \
      --max-new-tokens 128 --limit 24 --overwrite $graphs --output $OUT/cl$graphs > $OUT/cl$graphs.log 2>&1 || { echo "rollout $graphs: exit $?"; tail -5 $OUT/cl$graphs.log; }
  done
  python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def episodes(flag):
    path = out / f"cl{flag}" / "episodes.jsonl"
    return {r["id"]: [m.get("generated", m.get("content")) for m in r["messages"] if m["role"] == "assistant"] for r in map(json.loads, path.open())} if path.is_file() else {}
graphed, eager = episodes("--cuda-graphs"), episodes("--no-cuda-graphs")
for arm in ("base", "a", "b"):
    ids = sorted(k for k in eager if k.split(":")[-2] == arm)
    same = sum(graphed.get(k) == eager[k] for k in ids)
    print(f"closed_loop {arm}: {same} of {len(ids)} episodes equal with and without CUDA graphs")
for flag in ("--cuda-graphs", "--no-cuda-graphs"):
    summary = out / f"cl{flag}" / "summary.json"
    arms = json.loads(summary.read_text())["arms"] if summary.is_file() else {}
    print(f"closed_loop {flag} timing:", {a: v["timing"] for a, v in arms.items()} or "missing")
PY
  CUDA_VISIBLE_DEVICES=0 timeout 150 python bench/rollout_throughput.py --model $model --episodes 32 --concurrency 16 --turns 2 \
    --new-tokens 64 --arms slots --cuda-graphs --adapter /tmp/cl_adapters/a --workdir /tmp/rb --json $OUT/rollout_arms.json 2>&1 | tail -8 || echo "rollout bench with --adapter: exit $?"
  ;;
agent_seeds)
  # agent_1gpu's loop at seeds 0-4 side by side, AgentDemoConfig overrides as FIELD=VALUE; AGENT_SEEDS_NAME names the workdir, JSON and log, so that two studies can share one call (run both with &)
  shift; name=${AGENT_SEEDS_NAME:-agent_seeds}
  CUDA_VISIBLE_DEVICES=0 timeout 570 python bench/agent_seeds.py --seeds 0 1 2 3 4 --device cuda --parallel 5 --workdir /tmp/$name \
    --json $OUT/$name.json --set $agent_gpu "$@" > $OUT/$name.log 2>&1 || echo "$name: exit $?"
  tail -8 $OUT/$name.log
  ;;
rollout_phases)
  # the base commit's package and benches in .before/ (git archive, carried: it is git-ignored), then the tree, twice
  # (ROLLOUT_PHASES_ARMS="before after": once; another name X runs .X/); ROLLOUT_PHASES_EAGER=1 times the eager decoder instead of CUDA graphs; ROLLOUT_PHASES_ADAPTER=1 runs each tree's
  # base model and then make_adapters' adapter a (rank 16, lora_B from N(0, 0.02)) on the same episodes
  [ -d .before/eogym_sft ] || { echo "rollout_phases: no .before/: mkdir .before; git archive BASE eogym_sft bench | tar -x -C .before"; exit 1; }
  make_model
  mode="--arms none --cuda-graphs"; [ "${ROLLOUT_PHASES_EAGER:-0}" = 1 ] && mode="--arms slots"
  adapter=""
  if [ "${ROLLOUT_PHASES_ADAPTER:-0}" = 1 ]; then
    make_adapters; adapter="--adapter /tmp/cl_adapters/a"
  fi
  args="--model $model --episodes 48 --serial-episodes 0 --concurrency 32 --turns 3 --new-tokens 128 $mode $adapter --workdir /tmp/rb"
  i=0
  for arm in ${ROLLOUT_PHASES_ARMS:-before after before after}; do
    i=$((i + 1)); src=$PWD; [ $arm != after ] && src=$PWD/.$arm  # before: .before/; any other name X: .X/
    (cd "$src" && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/site:$src timeout 240 python bench/rollout_throughput.py $args \
      --json $OUT/rollout_${i}_$arm.json > $OUT/rollout_${i}_$arm.log 2>&1) || echo "rollout_phases: $arm exit $?"
    grep -E '^\{' $OUT/rollout_${i}_$arm.log | sed "s/^/$arm: /"
  done
  ;;
grpo_phases)
  # the grpo stage's slots arm (1 warm-up, 1 timed step) on .before/ then the tree; GRPO_PHASES_EXTRA="--flag value" runs
  # the tree once more with those recipe flags; GRPO_PHASES_ENGINES=slots,recipe runs the recipe's defaults too
  [ -d .before/eogym_sft ] || { echo "grpo_phases: no .before/: mkdir .before; git archive BASE eogym_sft bench recipes | tar -x -C .before"; exit 1; }
  make_model
  args="--model $model --arms ${GRPO_PHASES_ENGINES:-slots} --questions 2 --generations 8 --images 4-7 --image-px 1000 --calls 2 --call-tokens 96 --steps 1 --warmup 1 --workdir /tmp/grpo_phases"
  arms="before after"; [ -n "${GRPO_PHASES_EXTRA:-}" ] && arms="$arms extra"
  for arm in $arms; do
    src=$PWD; extra=""; [ $arm = before ] && src=$PWD/.before; [ $arm = extra ] && extra=$GRPO_PHASES_EXTRA
    (cd "$src" && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/site:$src timeout 240 python bench/grpo_step.py $args --recipe-args "$extra" \
      --json $OUT/grpo_$arm.json > $OUT/grpo_$arm.log 2>&1) || echo "grpo_phases: $arm exit $?"
    python -c "
import json
for a in json.load(open('$OUT/grpo_$arm.json'))['arms']:
    keys = ('step_s', 'generation_s', 'forward_backward_s', 'scoring_s', 'peak_allocated_gib')
    print('$arm', a['arm'], {k: round(a[k], 3) if isinstance(a.get(k), float) else a.get(k) for k in keys})" 2>&1 | tail -3
  done
  ;;
decoder_candidates)
  # a decoder change before and after in one call: its GPU tests, the rollout bench's graphs arm and the GRPO slots
  # step, each on .before/ and on the checkout; DECODER_CANDIDATES_ARMS="before tree_X after" adds a rollout arm on
  # .tree_X/ (made and carried like .before/)
  [ -d /tmp/site/trl ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  python -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/agent/test_decoder.py tests/agent/test_cuda_graphs.py tests/agent/test_merged_lora.py tests/agent/test_image_inputs.py tests/agent/test_text_norms.py tests/agent/test_sampling.py 2>&1 | tail -3 || echo "GPU tests failed"
  OUT=$OUT/rollout ROLLOUT_PHASES_ARMS="${DECODER_CANDIDATES_ARMS:-before after}" bash "$0" rollout_phases
  if [ $SECONDS -lt 330 ]; then OUT=$OUT/grpo timeout $((570 - SECONDS)) bash "$0" grpo_phases; else echo "decoder_candidates: no time left for grpo_phases"; fi
  ;;
agent_1gpu)
  # (after setup) seed 0 of agent_seeds alone: `eogym-sft demo --agent`'s loop at agent_gpu's settings; agent_report.json
  # holds Pass@1 per arm, the paired deltas, GRPO's reward per step and each stage's seconds
  CUDA_VISIBLE_DEVICES=0 timeout 570 python bench/agent_seeds.py --seeds 0 --device cuda --parallel 1 --workdir /tmp/agent_gpu \
    --json $OUT/agent_1gpu_seeds.json --set $agent_gpu \
    > $OUT/agent_1gpu.log 2>&1 || echo "agent_1gpu: exit $?"
  cp /tmp/agent_gpu/seed0/agent_report.json $OUT/agent_1gpu.json 2>/dev/null || echo "agent_1gpu: no report"
  grep -vE "Warning|warn|it/s\]|s/it\]" $OUT/agent_1gpu.log | tail -30
  ;;
sft_hostsync)
  # B-syncs (B with the collator's HostLayout off: the forward reads its layout back from the GPU) against B, in one
  # process, 1 warm-up + 3 timed steps each at the recipe's 32 micro-batches. On an 80 GB GPU:
  # SFT_HOSTSYNC_ARMS=B-b1-syncs,B-b1. SFT_HOSTSYNC_WARMUP=5 times steps of the second pass over the data.
  make_bench_data; mkdir -p /tmp/logs
  timeout $((${SFT_HOSTSYNC_LIMIT:-565} - SECONDS)) python bench/train_throughput.py --rows 220 --warmup ${SFT_HOSTSYNC_WARMUP:-1} \
    --steps ${SFT_HOSTSYNC_STEPS:-3} --grad-accum 32 --workdir /tmp/bt --parity-samples 0 --arms ${SFT_HOSTSYNC_ARMS:-B-syncs,B} --json $OUT/hostsync_armsB.json > $OUT/hostsync_armsB.log 2>&1 \
    || echo "arms B: exit $?"
  grep -vE "Warning|warn" $OUT/hostsync_armsB.log | tail -4
  ;;
patch_embed)
  # models/patch_embed.py: arms B-conv3d and B in one process, 1 warm-up + 2 timed steps each. On an 80 GB GPU:
  # PATCH_EMBED_ARMS=B-b1-conv3d,B-b1.
  lever_arms patch_embed ${PATCH_EMBED_ARMS:-B-conv3d,B} ${PATCH_EMBED_STEPS:-2} ${PATCH_EMBED_LIMIT:-575}
  ;;
vision_compile)
  # models/vision_blocks.py against the eager vision tower: its GPU test, then arms B-visioneager and B in one process,
  # 1 warm-up + 3 timed steps each. On an 80 GB GPU: VISION_COMPILE_ARMS=B-b1-visioneager,B-b1.
  timeout 150 python -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/models/test_vision_blocks.py \
    > $OUT/vision_compile_tests.log 2>&1 || echo "GPU tests: exit $?"
  tail -1 $OUT/vision_compile_tests.log
  lever_arms vision_compile ${VISION_COMPILE_ARMS:-B-visioneager,B} ${VISION_COMPILE_STEPS:-3} ${VISION_COMPILE_LIMIT:-575}
  ;;
levers)
  # B's MFU at steady state, and the two vision-tower levers together against B without them (B-nolevers). Both arms
  # time steps 6-8, the second pass over the data (the first ends inside step 5, then the 8 workers refill).
  lever_arms levers ${LEVERS_ARMS:-B,B-nolevers} ${LEVERS_STEPS:-3} ${LEVERS_LIMIT:-592} ${LEVERS_WARMUP:-5}
  ;;
gaps)
  # where the GPU waits on the host in one profiled step of ${GAPS_ARM:-B} (B-b1 on an 80 GB GPU): profile.gaps
  make_bench_data
  timeout $((${GAPS_LIMIT:-570} - SECONDS)) python bench/train_throughput.py --rows 220 --warmup 1 --steps 1 --grad-accum 32 \
    --workdir /tmp/bt --parity-samples 0 --arms ${GAPS_ARM:-B} --profile ${GAPS_ARM:-B} --json $OUT/gaps.json > $OUT/gaps.log 2>&1 \
    || echo "gaps: exit $?"
  python -c "import json; r = json.load(open('$OUT/gaps.json'))['results'][0]; g = r['profile']['gaps']
print(r['arm'], round(r['real_tokens_per_s']), 'gaps', g['count'], g['total_s'], 'of', g['kernels_span_s'])
for side in ('at_start', 'at_end'):
    print(side); [print(' ', x['s'], x['gaps'], x['op']) for x in g[side]]"
  ;;
validate_1gpu)
  # validate's forward on one random rank-16 adapter, 80 generated rows: its former padded path (old) against its
  # defaults (new), and new with the base arm too (new-2arms)
  make_model
  CUDA_VISIBLE_DEVICES=0 timeout $((580 - SECONDS)) python bench/validate_throughput.py --model $model --rows 80 --batch-size 8 \
    --old-batch-size 4 --paths old,new,new-2arms --workdir /tmp/vb --json $OUT/validate_1gpu.json 2>&1 \
    | grep -vE "Warning|warn" | tail -14 || echo "validate_throughput: exit $?"
  ;;
esac
