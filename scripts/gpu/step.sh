# Sourced by the GPU run scripts: `step NAME SECONDS COMMAND...` runs COMMAND with a time limit, its output in
# $OUT/NAME.log (the last TAIL lines, default 30, echoed), and adds a line to the SUMMARY array.
step() {
  local name=$1 limit=$2 begin rc
  shift 2
  begin=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  SUMMARY+=("$name: exit $rc, $(( $(date +%s) - begin )) s")
  tail -"${TAIL:-30}" "$OUT/$name.log"
}
