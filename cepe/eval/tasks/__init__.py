"""The paper's evaluation tasks; each module exposes ``Config`` and ``run(setup, config) -> result``.

| task | module | paper |
|---|---|---|
| ``lm`` | :mod:`.lm` | long-context language modelling (§4) |
| ``ralm`` | :mod:`.ralm` | retrieval-augmented language modelling (§5.1) |
| ``qa`` | :mod:`.qa` | open-domain QA (§5.2, App. C.1) |
| ``icl`` | :mod:`.icl` | in-context learning (§6, App. C.2) |
| ``longdoc`` | :mod:`.longdoc` | ZeroSCROLLS-style long-document tasks (§7, App. C.3) |
| ``needle`` | :mod:`.needle` | needle in a haystack (App. D) |
| ``copy`` | :mod:`.copy` | copy probe: a passage in the encoder, continued by the decoder |
| ``fixedppl`` | :mod:`.fixedppl` | perplexity of fixed targets against context length |
| ``ruler`` | :mod:`.ruler` | RULER's 13 synthetic tasks (not in the paper; a standard long-context suite) |
"""

TASKS = ("lm", "ralm", "qa", "icl", "longdoc", "needle", "copy", "fixedppl", "ruler")
