# stage_corpus NAME: the token corpus recipe NAME trains on (configs/train/recipe/NAME.yaml): the
# `corpus: runs/data/...` its config gives, or the one the config it extends gives, and so on; nothing
# when none does (the default set). Sourced by train_chain.sh and heads_and_validate.sh.
stage_corpus() {
  local f=configs/train/recipe/$1.yaml c e
  while [ -f "$f" ]; do
    c=$(grep -v '^ *#' "$f" | grep -oE 'corpus: *runs/data/[A-Za-z0-9_]+' | head -1 | sed 's/^corpus: *//' || true)
    if [ -n "$c" ]; then echo "$c"; return; fi
    e=$(sed -n 's/^extends: *//p' "$f" | head -1)
    [ -n "$e" ] || return 0
    f=$(dirname "$f")/$e
  done
}
# stage_init NAME: the init_adapter recipe NAME starts from, as its config or the configs it extends give it
# (the nearest wins); nothing when none does.
stage_init() {
  local f=configs/train/recipe/$1.yaml c e
  while [ -f "$f" ]; do
    c=$(sed -n 's/^init_adapter: *//p' "$f" | head -1)
    if [ -n "$c" ]; then echo "$c"; return; fi
    e=$(sed -n 's/^extends: *//p' "$f" | head -1)
    [ -n "$e" ] || return 0
    f=$(dirname "$f")/$e
  done
}
