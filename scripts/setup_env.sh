#!/usr/bin/env bash
# Creates ./.venv once and installs trl-dance (editable) with the extras given as $1 (e.g. "dev").
# Re-running is a no-op unless pyproject.toml or the extras changed.
#
# torch: TORCH_SPEC overrides the requirement (e.g. TORCH_SPEC="torch==2.13.0 --index-url <your CUDA index>").
# The default pins the release this project is tested with; pip then picks the build for your platform
# (the CUDA build on Linux x86_64 GPU machines, a local CPU wheel on the project's CI machines).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
venv="${TRL_DANCE_VENV:-.venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
stamp="$venv/.trl-dance-install"
want="$(sha1sum pyproject.toml | cut -d' ' -f1) [$extras] ${TORCH_SPEC:-torch==2.13.0}"
have="$(cat "$stamp" 2>/dev/null || true)"
# An install with more extras serves a request for fewer (the demo after the tests does not reinstall).
covered=0
if [ "${have%% *}" = "${want%% *}" ] && [ "${have##*] }" = "${want##*] }" ]; then
    installed=",$(echo "$have" | sed -E 's/^[^[]*\[([^]]*)\].*/\1/'),"
    covered=1
    for extra in ${extras//,/ }; do
        case "$installed" in *",$extra,"*) ;; *) covered=0 ;; esac
    done
fi
if [ "$covered" != 1 ]; then
    echo "Installing trl-dance[$extras] into $venv (about 2 minutes on a fresh machine)..."
    export PIP_DISABLE_PIP_VERSION_CHECK=1
    # shellcheck disable=SC2086
    # (This machine's pip config lists local wheel folders that may be absent; drop those warnings only.)
    "$venv/bin/pip" install -q ${TORCH_SPEC:-torch==2.13.0} 2> >(grep -v "^WARNING: Location" >&2)
    # The installed torch stays: without it as a requirement here, a package that needs torchvision (EasyOCR) makes
    # pip pick the newest torchvision and replace torch with the release that one was built for.
    torch_pin="torch==$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
    "$venv/bin/pip" install -q -e ".${extras:+[$extras]}" "$torch_pin" 2> >(grep -v "^WARNING: Location" >&2)
    # PyPI's torchvision (EasyOCR needs it) is built for CUDA torch and fails to import beside a CPU one, and so does
    # every transformers import once it is installed: a .pth file declares its two unguarded operators at the first
    # `import torchvision` of any program in this environment (trl_dance/_torchvision.py; a no-op where it loads).
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    hook="$PWD/trl_dance/_torchvision.py"
    echo "import importlib.util as u, os; p = '$hook'; s = u.spec_from_file_location('_trl_dance_torchvision', p) if os.path.isfile(p) else None; m = s and u.module_from_spec(s); s and s.loader.exec_module(m); s and m.install_import_hook()" \
        > "$site/trl_dance_torchvision.pth"
    # torch's OpenMP threads sleep between operations in every program of this environment (their default spin
    # made the README's Python example 36x slower on a loaded 2-core machine; see docs/faq.md); a user's setting wins.
    echo "import os; os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')" > "$site/trl_dance_threads.pth"
    case ",$extras," in *,dev,*)
        # The reward adapters are tested against the packages users score with (tests/reference_packages.py). hpsv2
        # and image-reward pin 2023 releases of pytest, timm and protobuf that would replace this environment's, so
        # they and the two small packages their imports need go in without their requirements (the rest is here).
        "$venv/bin/pip" install -q --no-deps --no-build-isolation hpsv2==1.2.0 image-reward==1.5 fairscale==0.4.13 \
            clint==0.5.1 2> >(grep -v "^WARNING: Location" >&2)
        # hpsv2 1.2.0's wheel lacks its tokenizer's BPE table; open_clip_torch (a dev requirement) ships that file.
        cp "$site/open_clip/bpe_simple_vocab_16e6.txt.gz" "$site/hpsv2/src/open_clip/"
        ;;
    esac
    "$venv/bin/python" -c "import transformers, torch, trl, diffusers, trl_dance" # fail loudly if the install did not work
    case ",$extras," in *,deepspeed,*)
        # DeepSpeed compiles its CPU shared-memory collectives on first use (about a minute): once, at install.
        "$venv/bin/python" -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load()" \
            > /dev/null 2> >(grep -v "^\[" >&2)
        ;;
    esac
    echo "$want" > "$stamp"
fi
