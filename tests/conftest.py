import torch

# Tiny test models gain nothing from intra-op threads, and on a loaded 2-core runner
# small ops at 2 threads stall; the suite runs single-threaded.
torch.set_num_threads(1)
