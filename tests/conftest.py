import os

# Keep each test process small on a 2-core machine; spawned ranks set their own thread counts.
os.environ.setdefault("OMP_NUM_THREADS", "1")
