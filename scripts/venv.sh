# Sourced by the other scripts: creates .venv with gpuguard and its dev tools, again only when
# pyproject.toml or constraints.txt changed. Runtime dependencies are installed at the versions pinned
# in constraints.txt, the ones the Dockerfile ships. Needs Python 3.11+ as python3 (or $PYTHON).
venv_dir=${GPUGUARD_VENV:-.venv}
# Absolute, so that PATH below holds whether GPUGUARD_VENV was given relative or absolute.
case $venv_dir in /*) ;; *) venv_dir="$PWD/$venv_dir" ;; esac
python=${PYTHON:-python3}
stamp="$venv_dir/.gpuguard-installed"
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ ! -x "$venv_dir/bin/python" ]; then
  "$python" -m venv "$venv_dir"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$venv_dir/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
  "$venv_dir/bin/python" -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
  echo "$want" > "$stamp"
fi
export PATH="$venv_dir/bin:$PATH"
