# One forward and one backward of the Gluon cache kernels at the 340M bench shape (65,536 tokens, 4 x 256), for ncu.
import torch
from hola_titan.kernels import hola_triton_select as S
from hola_titan.kernels.hola_triton_ops import cache_attn_bwd_op, cache_attn_op
dev = torch.device("cuda")
tokens, t, h, d, block, window = 65536, 2048, 4, 256, 256, 64
g = torch.Generator(device=dev).manual_seed(3)
q, k, v, o_state, do = (torch.randn(1, tokens, h, d, device=dev, generator=g).to(torch.bfloat16) for _ in range(5))
gq, gk = (1 + 0.3 * torch.randn(d, device=dev, generator=g) for _ in range(2))
sink, gate = torch.randn(h, device=dev, generator=g), torch.randn(h, device=dev, generator=g)
cu = torch.arange(0, tokens + 1, t, device=dev)
table = S.build_block_table(1, tokens, cu, block, dev)
sel, _ = S.select_topw(torch.rand(tokens, h, device=dev, generator=g), table, window)
fwd = cache_attn_op(q, k, v, o_state, gq, gk, sink, gate, sel, table.blk_start, table.blk_len, block, window, False)
cache_attn_bwd_op(do, q, k, v, fwd[1], fwd[2], fwd[3], gq, gk, sink, gate, sel, table.blk_start, table.blk_len, block,
                  window, None)
torch.cuda.synchronize()
print("done")
