#!/usr/bin/env bash
# The Triton cache kernels at head dim 256 with their CONFIGS launches (hola_triton_attn.py), compiled for sm_80 and
# sm_90 on a CPU. The D 256 plans list the Gluon kernels, so the argument types come from the D 128 plan's Triton
# kernels and D is set to 256 (--sweep D=256). Usage: run.sh OUT_DIR [PYTHON]; Triton is whichever PYTHON imports.
set -u
out=$1; py=${2:-python}
plan=hola/d128/h2/bfloat16/packed
run() {  # name kernel [--function F] [--alias ...] -- sweep...
  local name=$1; shift
  for arch in 80 90; do
    $py scripts/kernel_resources.py --plan $plan --arch $arch --json "$out/${name}_sm$arch.json" "$@" 2>/dev/null \
      | tail -n 1 | sed "s/^/$name sm_$arch: /"
  done
}
launch="--warps 4 --stages 2"  # the CONFIGS launches at D 256: warps and stages
fwd="--sweep D=256 BM=64 BN=32"
bwd="--sweep D=256 BM=32 BN=32"
run fwd --kernel _cache_fwd_kernel $fwd $launch
run dq --kernel _cache_bwd_dq_kernel $bwd $launch
run dkdv --kernel _cache_bwd_dkdv_kernel $bwd $launch
# model.save_cache_output (kept output; DQ_ATOMIC at D 256)
run fwd_oc --kernel _cache_fwd_kernel --function _cache_fwd_oc_kernel --alias oc_ptr=o_ptr $fwd SPLIT=1 $launch
run dq_oc_delta --kernel _cache_bwd_dq_kernel --function _cache_bwd_dq_oc_kernel --alias oc_ptr=do_ptr $bwd DELTA_ONLY=True $launch
run dq_oc --kernel _cache_bwd_dq_kernel --function _cache_bwd_dq_oc_kernel --alias oc_ptr=do_ptr $bwd DELTA_ONLY=False $launch
run dkdv_dq_atomic --kernel _cache_bwd_dkdv_kernel --function _cache_bwd_dkdv_dq_kernel --alias dqa_ptr=pdk_ptr $bwd $launch
run dq_finish --kernel _cache_bwd_dq_kernel --function _cache_bwd_dq_finish_kernel --alias dqa_ptr=dgq_ptr \
  --sweep D=256 BM=32 $launch
# a call continuing from a cache (context-parallel shards): prefix rows
run fwd_pre --kernel _cache_fwd_kernel --function _cache_fwd_pre_kernel \
  --alias ka_ptr=k_ptr va_ptr=v_ptr rka_ptr=rk_ptr pre_start_ptr=blk_start_ptr pre_len_ptr=blk_len_ptr $fwd $launch
run dq_pre --kernel _cache_bwd_dq_kernel --function _cache_bwd_dq_pre_kernel \
  --alias ka_ptr=k_ptr va_ptr=v_ptr rka_ptr=rk_ptr pre_start_ptr=blk_start_ptr pre_len_ptr=blk_len_ptr $bwd $launch
run dkdv_pre --kernel _cache_bwd_dkdv_kernel --function _cache_bwd_dkdv_pre_kernel \
  --alias ka_ptr=k_ptr va_ptr=v_ptr rka_ptr=rk_ptr pre_start_ptr=blk_start_ptr pre_len_ptr=blk_len_ptr \
  dka_ptr=dk_ptr dva_ptr=dv_ptr A_BASE=H $bwd $launch
# The rest of a HOLA 340M step (4 heads x 256, bf16, packed) with the plan's own launches: this project's fused
# kernels, and fla's with the configurations the H200 table chose (what an A100 would run if given that table).
plan=hola/d256/h4/bfloat16/packed
for k in _short_conv_fwd_kernel _short_conv_bwd_dz_kernel _short_conv_bwd_dx_kernel _xent_rows_kernel _rstd_kernel \
    _block_topw_kernel _merge_topw_kernel _scatter_cache_grads_kernel l2norm_fwd_kernel l2norm_bwd_kernel \
    chunk_local_cumsum_scalar_kernel chunk_gated_delta_rule_fwd_kkt_solve_kernel recompute_w_u_fwd_kernel \
    chunk_gated_delta_rule_fwd_kernel_h_blockdim64 chunk_fwd_kernel_o chunk_bwd_kernel_dv_local \
    chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64 chunk_bwd_kernel_dqkwg prepare_wy_repr_bwd_kernel; do
  run "$k" --kernel "$k"
done
