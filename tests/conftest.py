import torch

# The tiny test models gain nothing from several threads, and on a busy 2-core machine OpenMP
# threads that wait for each other make every small op ~30x slower. One thread also fixes the
# reduction order (the golden records were made with one thread too).
torch.set_num_threads(1)
