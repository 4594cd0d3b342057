import hashlib, time, threading, os
import numpy as np
try:
    import google_crc32c as gc
except Exception:
    gc = None
try:
    import crc32c as c2
except Exception:
    c2 = None
buf = np.random.default_rng(0).integers(0, 255, size=64 << 20, dtype=np.uint8)
mv = memoryview(buf)
def rate(fn, n=3):
    best = 1e9
    for _ in range(n):
        t = time.perf_counter(); fn(); best = min(best, time.perf_counter() - t)
    return (64 << 20) / best / 1e9
cands = {
    "blake2b": lambda: hashlib.blake2b(mv).digest(),
    "blake2b-32": lambda: hashlib.blake2b(mv, digest_size=32).digest(),
    "sha256": lambda: hashlib.sha256(mv).digest(),
    "sha1": lambda: hashlib.sha1(mv).digest(),
    "sha256-4MiB-chunks": lambda: [hashlib.sha256(mv[i:i+(4<<20)]).digest() for i in range(0, len(mv), 4<<20)],
}
pass
if c2: cands["crc32c(pkg)"] = lambda: c2.crc32c(mv)
for k, f in cands.items():
    single = rate(f)
    # GIL release: 2 threads at once, each hashing the buffer
    def two():
        ts = [threading.Thread(target=f) for _ in range(2)]
        [t.start() for t in ts]; [t.join() for t in ts]
    both = rate(two) * 2
    # python thread progress while hashing: count loop iterations in main thread
    stop = [False]; cnt = [0]
    def spin():
        while not stop[0]: cnt[0] += 1
    th = threading.Thread(target=spin); th.start(); time.sleep(0.05); c0 = cnt[0]; t0=time.perf_counter()
    f(); f(); el = time.perf_counter()-t0; c1 = cnt[0]; stop[0] = True; th.join()
    print(f"{k:16s} 1 thread {single:5.2f} GB/s  2 threads {both:5.2f} GB/s  python thread ran {(c1-c0)/el/1e6:5.2f} M it/s while hashing", flush=True)
stop=[False]; cnt=[0]
th = threading.Thread(target=spin); th.start(); time.sleep(0.05); c0=cnt[0]; t0=time.perf_counter(); time.sleep(0.3); el=time.perf_counter()-t0; c1=cnt[0]; stop[0]=True; th.join()
print(f"baseline python thread alone {(c1-c0)/el/1e6:5.2f} M it/s; load {os.getloadavg()}")
