"""Plain classes run inside Ray actors (or alone): model bootstrap, engines, runners, the learner."""

import logging

# bitsandbytes (extra `qlora`; peft imports it) warns at import, on a CPU with AVX512-BF16, that an optional
# kernel from the Hub is missing, in every process. Its own CPU path, which actors/qlora.py uses, needs none.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
