# Sourced by lab/gpu_ab.sh and lab/profile_ab.sh: a VARIANT is a patch, or patches joined by "+"
# applied in that order onto the tree.
patches_of() { tr '+' ' ' <<< "$1"; }  # VARIANT -> its patches, space-separated
unapply() {  # PATCH...: reversed, the last applied first
  local i patches=("$@")
  for (( i = ${#patches[@]} - 1; i >= 0; i-- )); do git apply -R "${patches[$i]}"; done
}
# SCRIPT VARIANT...: each variant's patches applied in order (a later one may build on an earlier
# one) and reversed, before any run; exits 2 naming the first that does not apply.
check_variants() {
  local script=$1 v p applied
  shift
  for v in "$@"; do
    applied=()
    for p in $(patches_of "$v"); do
      if ! git apply --check "$p" || ! git apply "$p"; then
        echo "$script: $p does not apply (variant $v)" >&2
        unapply "${applied[@]}"
        exit 2
      fi
      applied+=("$p")
    done
    unapply "${applied[@]}"
  done
}
