#!/usr/bin/env bash
# Every head kind on the embedded default, on the same data and the same training minutes, then
# measured in our runtime (every kind's drafters in one run, scripts/bench_draft_cost.py) and in
# vLLM (scripts/bench_engine.py):
#
#   bash scripts/bench_kinds.sh [MINUTES] [RECORDS] [PROMPTS] [OUT] [norms]   # defaults: 3 1536 6 runs/kinds
#
# The data is the first RECORDS conversations of the self-distilled corpus that
# conf/recipe/eagle3_smollm2_135m_corpus.yaml builds (its regenerate stage; shards already written
# are reused, missing ones are regenerated first). Each kind's warmup and decay are laid over its
# MINUTES (trainer.schedule_clock=minutes): kinds differ in step time, so no step count is equal
# for all. One heavy job at a time: the jobs run in turn.
# Each job trains and exports (no eval stage: the draft-cost run below times every kind in one
# process instead). vLLM's report is OUT/engine_k3/report.md (EAGLE-1/2,
# EAGLE-3, P-EAGLE and Medusa at K=3) and OUT/engine_dflash/report.md (DFlash at K=15: vLLM drafts a
# DFlash block as 1+K query tokens, so K = block size - 1 is the block the drafter proposes).
# Then every kind's drafters run in one process on the same prompts (OUT/draft_cost.json, from
# scripts/bench_draft_cost.py: draft cost per step in EAGLE head forwards) and
# scripts/kinds_table.py prints the table of all of it. With `norms` last, EAGLE-3 then trains again
# with each EAGLE-3.1 option alone (norm_before_fc, fc_norm, norm_output) on the same data and
# minutes, training only (OUT/eagle3_<option>), and `kinds_table.py --norms` prints them beside the
# EAGLE-3 run above.
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES=${1:-3}
RECORDS=${2:-1536}
PROMPTS=${3:-6}
OUT=${4:-runs/kinds}
NORMS=${5:-}
PY=.venv/bin/python
export OMP_WAIT_POLICY=PASSIVE
COMMON=(data.max_records="$RECORDS" data.eval_fraction=0.03
        data.regenerate.output_dir=runs/regenerated/sharegpt_first_exchange data.regenerate.generator=lean
        data.regenerate.batch_size=48 trainer.max_minutes="$MINUTES" trainer.max_steps=100000 trainer.schedule_clock=minutes
        trainer.num_threads=2 logger=none runtime.num_prompts="$PROMPTS")
mkdir -p "$OUT"
for recipe in eagle_smollm2_135m eagle3_smollm2_135m peagle_smollm2_135m dflash_smollm2_135m medusa_smollm2_135m; do
  echo "$(date -u +%FT%TZ) $recipe"
  $PY -m train +recipe=$recipe "${COMMON[@]}" 'stages=[data,train,export]' trainer.output_dir="$OUT/$recipe" \
    > "$OUT/$recipe.log" 2>&1
done
echo "$(date -u +%FT%TZ) vLLM"
$PY scripts/bench_engine.py --head "$OUT/eagle_smollm2_135m/export/native" \
  --head "$OUT/eagle3_smollm2_135m/export/native" --head "$OUT/peagle_smollm2_135m/export/native" \
  --head "$OUT/medusa_smollm2_135m/export/native" \
  --prompts "$PROMPTS" --tokens 48 --k 3 --no-transformers --out "$OUT/engine_k3" > "$OUT/engine_k3.log" 2>&1
$PY scripts/bench_engine.py --head "$OUT/dflash_smollm2_135m/export/native" \
  --prompts "$PROMPTS" --tokens 48 --k 15 --no-transformers --out "$OUT/engine_dflash" > "$OUT/engine_dflash.log" 2>&1
echo "$(date -u +%FT%TZ) draft cost"
$PY scripts/bench_draft_cost.py $(for r in eagle eagle3 peagle dflash medusa; do echo --head "$OUT/${r}_smollm2_135m/export/native"; done) \
  --prompts "$PROMPTS" --tokens 48 --json "$OUT/draft_cost.json" > "$OUT/draft_cost.log" 2>&1
$PY scripts/kinds_table.py "$OUT"
if [ "$NORMS" = norms ]; then
  for option in norm_before_fc fc_norm norm_output; do
    echo "$(date -u +%FT%TZ) eagle3 $option"
    $PY -m train +recipe=eagle3_smollm2_135m "${COMMON[@]}" heads.eagle3.$option=true 'stages=[data,train]' \
      trainer.output_dir="$OUT/eagle3_$option" > "$OUT/eagle3_$option.log" 2>&1
  done
  $PY scripts/kinds_table.py "$OUT" --norms
fi
echo "$(date -u +%FT%TZ) done"
