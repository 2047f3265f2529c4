#!/usr/bin/env bash
# The GPU runs behind docs/benchmarks.md on an H200 host (2 GPUs for scaling and balance_x2), wheels the image lacks
# installed from .whl/ (bench/README.md): `bash bench/h200_session.sh STAGE [ARGS]`, one stage a call, setup first on
# a fresh host; the stages are the case labels below. rollout_phases, grpo_phases and decoder_candidates time a base
# commit's tree beside the checkout: first, here, mkdir .before; git archive BASE eogym_sft bench recipes | tar -x -C
# .before (git-ignored: carry .before).
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
decoder_tests="tests/agent/test_decoder.py tests/agent/test_cuda_graphs.py tests/agent/test_merged_lora.py
  tests/agent/test_image_inputs.py tests/agent/test_text_norms.py tests/agent/test_sampling.py"

install() { [ -d /tmp/site/trl ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; }
gpu_tests() { python -m pytest -q -p no:cacheprovider -o addopts="" "$@" 2>&1 | tail -3 || echo "GPU tests failed"; }
make_model() { [ -f $model/config.json ] || python -m eogym_sft.cli tiny-model --config $cfg --dtype bfloat16 --device cuda --output $model; }
make_adapters() {  # two random rank-16 adapters of the recipe's targets, lora_B from N(0, 0.02), seeds 1 and 2: /tmp/cl_adapters/{a,b}
  [ -f /tmp/cl_adapters/b/adapter_config.json ] || python -c "
import torch; from eogym_sft.models.loading import apply_lora, load_base_model
model = apply_lora(load_base_model('$model', 'bfloat16'))
for name, seed in (('a', 1), ('b', 2)):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        [p.copy_(torch.randn(p.shape, generator=g) * 0.02) for n, p in model.named_parameters() if 'lora_B' in n]
    model.save_pretrained('/tmp/cl_adapters/' + name)"
}
make_bench_data() {  # the benches' /tmp/bt sample (220 rows, prepared), without building arm B's model
  [ -f /tmp/bt/prepared/stats.json ] || python -c "
import sys; from pathlib import Path; sys.path.insert(0, 'bench')
import train_throughput as t
from eogym_sft.models.tiny import build_offline_processor
work = Path('/tmp/bt'); proc = work / 'processor'; build_offline_processor().save_pretrained(proc)
(proc / 'config.json').write_text(Path('$cfg').read_text()); t.prepare_data(work, 220, proc)" > /tmp/bench_data.log 2>&1 || { tail -5 /tmp/bench_data.log; exit 1; }
}
arms() {  # train_throughput arms in one process, 220 rows, 32 micro-batches a step: STAGE ARMS TIMED_STEPS LIMIT_S [WARM-UP, 1]
  make_bench_data  # A_STEPS: arm A's timed steps (default TIMED_STEPS)
  timeout $(($4 - SECONDS)) python bench/train_throughput.py --rows 220 --warmup ${5:-1} --steps $3 --a-steps ${A_STEPS:-$3} --grad-accum 32 \
    --workdir /tmp/bt --parity-samples 0 --arms $2 --json $OUT/$1_arms.json > $OUT/$1_arms.log 2>&1 || echo "arms: exit $?"
  grep -vE "Warning|warn" $OUT/$1_arms.log | tail -4
}
make_data() { [ -f $data/train.jsonl ] || python -c "import sys; sys.path.insert(0, 'bench'); from common import generate_sample; generate_sample('$data', rows=${1:-240}, seed=0)"; }

case "$1" in
setup)
  install
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch, transformers, trl, peft, accelerate, deepspeed, datasets; print({m.__name__: m.__version__ for m in (torch, transformers, trl, peft, accelerate, deepspeed, datasets)}, torch.version.cuda)"
  gpu_tests tests/models/test_attention.py tests/data/test_collator.py $decoder_tests
  ;;
train_bench_1)
  CUDA_VISIBLE_DEVICES=0 python bench/train_throughput.py $bench --arms A,B,B-b1,B-b1-GC,B-GC --json $OUT/train_1gpu_part1.json
  ;;
train_bench_2)
  CUDA_VISIBLE_DEVICES=0 python bench/train_throughput.py $bench --arms B,B-nocompile,B-fixedcount,A,B-dropout0,B-padded --parity-samples 0 --json $OUT/train_1gpu_part2.json
  ;;
prep_bench)  # the target: EO-Gym's 7,642-row train split in under 60 s on 16 cores, every image checked to its end
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
balance_x2)  # 2 GPUs, ZeRO-2: token-balanced (B) against fixed-count micro-batches, 16 micro-batches of 2 a GPU a step
  make_bench_data
  timeout $((585 - SECONDS)) accelerate launch --config_file recipes/accelerate/deepspeed_zero2.yaml --num_processes 2 \
    bench/train_throughput.py --rows 220 --warmup 1 --steps 3 --grad-accum 16 --workdir /tmp/bt --parity-samples 0 \
    --arms B,B-fixedcount --json $OUT/balance_x2.json > $OUT/balance_x2.log 2>&1 || echo "balance_x2: exit $?"
  grep -vE "Warning|warn" $OUT/balance_x2.log | tail -6
  ;;
after_1gpu)  # the headline: A and B in one process; AFTER_ARMS (A,B-plan: as the plan sizes it), AFTER_STEPS, A_STEPS
  arms after ${AFTER_ARMS:-A,B} ${AFTER_STEPS:-4} ${AFTER_LIMIT:-560}
  ;;
readme_command)  # the README's SFT launch unchanged but for the model, data, output and 2 steps: its exit, plan line and logs
  make_model; make_bench_data
  launch="accelerate launch --config_file recipes/accelerate/deepspeed_zero2.yaml recipes/eo_gym_4b.py --config recipes/eo_gym_4b.yaml
    --model_name_or_path $model --dataset_path /tmp/bt/sample/train.jsonl --data_root /tmp/bt/sample/data --output_dir /tmp/readme_run
    --max_steps 2 --logging_steps 1"
  rc=0; timeout 400 $launch > $OUT/readme_command.log 2>&1 || rc=$?
  python bench/common.py readme-log $OUT/readme_command.log $rc "$(nvidia-smi --query-gpu=name --format=csv,noheader)" "$launch" \
    > $OUT/readme_command.json
  tail -c 600 $OUT/readme_command.json
  ;;
defaults)  # validate, evaluate and rollout at their defaults, base + a random adapter: nvidia-smi's peak, every 200 ms
  make_model; make_data 24; make_adapters
  common="--model $model --adapter a=/tmp/cl_adapters/a --data-root $data/data --overwrite"
  for run in "rollout --data $data/train.jsonl --limit 12 --samples 4 --temperature 1 --max-turns 3 --output /tmp/defaults_out/rollout_defaults" \
             "evaluate --data $data/train.jsonl --limit 4 --output /tmp/defaults_out/evaluate_defaults" \
             "validate --data $data/train.jsonl --output /tmp/defaults_out/validate_defaults.json"; do
    name=${run%% *}
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader,nounits -lms 200 > $OUT/${name}_smi.csv &
    smi=$!
    CUDA_VISIBLE_DEVICES=0 timeout 150 python -m eogym_sft.cli $run $common > $OUT/${name}_defaults.log 2>&1 || echo "$name: exit $?"
    kill $smi; sort -t, -k1 -n $OUT/${name}_smi.csv | tail -1 | sed "s/^/$name peak MiB used, total: /"
    grep -iE "memory plan|slots|batch|Error" $OUT/${name}_defaults.log | grep -v Warning | tail -3
  done
  python bench/common.py defaults $OUT "$(nvidia-smi --query-gpu=name --format=csv,noheader)" > $OUT/defaults.json
  ;;
rollout_bench)
  make_model
  CUDA_VISIBLE_DEVICES=0 python bench/rollout_throughput.py --model $model --episodes 48 --serial-episodes 1 --concurrency 32 \
    --turns 3 --new-tokens 128 --cuda-graphs --workdir /tmp/rb --json $OUT/rollout.json
  ;;
grpo)
  # one step of the seed's scale (2 questions x 8 episodes, 4-7 images of 1000 px, 2 forced crop turns of 96 tokens
  # then an answer) on TRL's loop, the slot decoder and the recipe's own defaults; the decoder's CUDA-graph test first
  install; make_model
  gpu_tests tests/training/test_grpo_slots.py -k cuda_graphs
  CUDA_VISIBLE_DEVICES=0 timeout 480 python bench/grpo_step.py --model $model --arms trl,slots,recipe --questions 2 --generations 8 \
    --images 4-7 --image-px 1000 --calls 2 --call-tokens 96 --steps 1 --warmup 1 --workdir /tmp/grpo_bench \
    --json $OUT/grpo_engines.json > $OUT/grpo_engines.log 2>&1 || echo "grpo: exit $?"
  grep -E "^step |^arm|^trl|^slots|^recipe|Error|error" $OUT/grpo_engines.log | tail -30
  ;;
closed_loop_1gpu)  # `eogym-sft rollout` with base + 2 adapters, with and without CUDA graphs: the same greedy episodes
  make_model; make_data 48
  gpu_tests -m gpu $decoder_tests
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
    print(f"closed_loop {arm}: {sum(graphed.get(k) == eager[k] for k in ids)} of {len(ids)} episodes equal with and without CUDA graphs")
for flag in ("--cuda-graphs", "--no-cuda-graphs"):
    summary = out / f"cl{flag}" / "summary.json"
    arms = json.loads(summary.read_text())["arms"] if summary.is_file() else {}
    print(f"closed_loop {flag} timing:", {a: v["timing"] for a, v in arms.items()} or "missing")
PY
  CUDA_VISIBLE_DEVICES=0 timeout 150 python bench/rollout_throughput.py --model $model --episodes 32 --concurrency 16 --turns 2 \
    --new-tokens 64 --arms slots --cuda-graphs --adapter /tmp/cl_adapters/a --workdir /tmp/rb --json $OUT/rollout_arms.json 2>&1 | tail -8 || echo "rollout bench with --adapter: exit $?"
  ;;
agent_seeds)
  # agent_1gpu's loop on AGENT_SEEDS side by side (default: tuning seeds 10-14; a report: AGENT_SEEDS="30 ... 39"
  # AGENT_SEEDS_FLAGS=--headline), AgentDemoConfig overrides as FIELD=VALUE; AGENT_SEEDS_NAME names the workdir, JSON
  # and log, so that two studies can share one call (run both with &); at most 10 seeds in all a call, one process a
  # seed on the 16-core host: 14 at once overran the call's 570 s
  shift; name=${AGENT_SEEDS_NAME:-agent_seeds}; seeds=${AGENT_SEEDS:-10 11 12 13 14}
  CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=1 timeout 570 python bench/agent_seeds.py --seeds $seeds --device cuda \
    --parallel $(echo $seeds | wc -w) ${AGENT_SEEDS_FLAGS:-} --workdir /tmp/$name --json $OUT/$name.json --set $agent_gpu "$@" \
    > $OUT/$name.log 2>&1 || echo "$name: exit $?"
  tail -8 $OUT/$name.log
  ;;
rollout_phases)
  # the rollout bench on .before/ (a base commit's tree), then the checkout, twice (ROLLOUT_PHASES_ARMS="before after":
  # once; another name X runs .X/); ROLLOUT_PHASES_EAGER=1: the eager decoder instead of CUDA graphs;
  # ROLLOUT_PHASES_ADAPTER=1: each tree's base model, then make_adapters' adapter a, on the same episodes
  [ -d .before/eogym_sft ] || { echo "rollout_phases: no .before/: mkdir .before; git archive BASE eogym_sft bench | tar -x -C .before"; exit 1; }
  make_model
  mode="--arms none --cuda-graphs"; [ "${ROLLOUT_PHASES_EAGER:-0}" = 1 ] && mode="--arms slots"
  adapter=""; [ "${ROLLOUT_PHASES_ADAPTER:-0}" = 1 ] && { make_adapters; adapter="--adapter /tmp/cl_adapters/a"; }
  args="--model $model --episodes 48 --serial-episodes 0 --concurrency 32 --turns 3 --new-tokens 128 $mode $adapter --workdir /tmp/rb"
  i=0
  for arm in ${ROLLOUT_PHASES_ARMS:-before after before after}; do
    i=$((i + 1)); src=$PWD; [ $arm != after ] && src=$PWD/.$arm
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
  trees="before after"; [ -n "${GRPO_PHASES_EXTRA:-}" ] && trees="$trees extra"
  for arm in $trees; do
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
  # a decoder change before and after in one call: its GPU tests, rollout_phases and grpo_phases;
  # DECODER_CANDIDATES_ARMS="before tree_X after" adds a rollout arm on .tree_X/ (made and carried like .before/)
  install
  gpu_tests -m gpu $decoder_tests
  OUT=$OUT/rollout ROLLOUT_PHASES_ARMS="${DECODER_CANDIDATES_ARMS:-before after}" bash "$0" rollout_phases
  if [ $SECONDS -lt 330 ]; then OUT=$OUT/grpo timeout $((570 - SECONDS)) bash "$0" grpo_phases; else echo "decoder_candidates: no time left for grpo_phases"; fi
  ;;
agent_1gpu)
  # (after setup) seed 0 of agent_seeds alone: `eogym-sft demo --agent`'s loop at agent_gpu's settings; agent_report.json
  # holds Pass@1 per arm, the paired deltas, GRPO's reward per step and each stage's seconds
  CUDA_VISIBLE_DEVICES=0 timeout 570 python bench/agent_seeds.py --seeds 0 --device cuda --parallel 1 --workdir /tmp/agent_gpu \
    --json $OUT/agent_1gpu_seeds.json --set $agent_gpu > $OUT/agent_1gpu.log 2>&1 || echo "agent_1gpu: exit $?"
  cp /tmp/agent_gpu/seed0/agent_report.json $OUT/agent_1gpu.json 2>/dev/null || echo "agent_1gpu: no report"
  grep -vE "Warning|warn|it/s\]|s/it\]" $OUT/agent_1gpu.log | tail -30
  ;;
sft_hostsync)
  # B-syncs (the collator without HostLayout: the forward reads its layout back from the GPU) against B, 1 warm-up + 3
  # timed steps each. On an 80 GB GPU: SFT_HOSTSYNC_ARMS=B-b1-syncs,B-b1. SFT_HOSTSYNC_WARMUP=5: the second pass.
  arms sft_hostsync ${SFT_HOSTSYNC_ARMS:-B-syncs,B} ${SFT_HOSTSYNC_STEPS:-3} ${SFT_HOSTSYNC_LIMIT:-565} ${SFT_HOSTSYNC_WARMUP:-1}
  ;;
patch_embed)  # models/patch_embed.py: B-conv3d against B, 1 warm-up + 2 timed steps. 80 GB: PATCH_EMBED_ARMS=B-b1-conv3d,B-b1
  arms patch_embed ${PATCH_EMBED_ARMS:-B-conv3d,B} ${PATCH_EMBED_STEPS:-2} ${PATCH_EMBED_LIMIT:-575}
  ;;
vision_compile)
  # models/vision_blocks.py against the eager vision tower: its GPU test, then B-visioneager and B, 1 warm-up + 3 timed
  # steps each. On an 80 GB GPU: VISION_COMPILE_ARMS=B-b1-visioneager,B-b1.
  timeout 150 python -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/models/test_vision_blocks.py \
    > $OUT/vision_compile_tests.log 2>&1 || echo "GPU tests: exit $?"
  tail -1 $OUT/vision_compile_tests.log
  arms vision_compile ${VISION_COMPILE_ARMS:-B-visioneager,B} ${VISION_COMPILE_STEPS:-3} ${VISION_COMPILE_LIMIT:-575}
  ;;
levers)
  # B's MFU at steady state, and the two vision-tower levers together against B without them (B-nolevers), both over
  # steps 6-8, the second pass over the data (the first ends inside step 5, then the 8 workers refill)
  arms levers ${LEVERS_ARMS:-B,B-nolevers} ${LEVERS_STEPS:-3} ${LEVERS_LIMIT:-592} ${LEVERS_WARMUP:-5}
  ;;
validate_1gpu)  # validate's forward, one random rank-16 adapter, 80 rows: the old padded path, the defaults, both arms
  make_model
  CUDA_VISIBLE_DEVICES=0 timeout $((580 - SECONDS)) python bench/validate_throughput.py --model $model --rows 80 --batch-size 8 \
    --old-batch-size 4 --paths old,new,new-2arms --workdir /tmp/vb --json $OUT/validate_1gpu.json 2>&1 \
    | grep -vE "Warning|warn" | tail -14 || echo "validate_throughput: exit $?"
  ;;
*)
  echo "unknown stage: ${1:-none} (the stages: this script's header)"; exit 2
  ;;
esac
