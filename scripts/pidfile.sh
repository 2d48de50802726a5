# pid_running FILE WORD: the pid written in FILE is a live process whose command line holds WORD. A pid file
# left by a killed run may name a pid that a later boot gave to another process; where /proc is readable the
# command line tells them apart, elsewhere a live pid is trusted. Sourced by the chain scripts.
pid_running() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
  [ -r "/proc/$pid/cmdline" ] || return 0
  tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q -- "$2"
}
