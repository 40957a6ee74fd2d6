#!/bin/sh
# Entrypoint of the pagestream image (runs under tini, see docker/Dockerfile).
#
#   (no arguments)            pagestream serve --host 0.0.0.0 --port $PAGESTREAM_PORT
#   --model /models/x ...     the same, with these options added
#   serve --max-num-seqs 64   the same (the listening defaults are still added)
#   make-model /models/tiny   pagestream make-model /models/tiny   (any other subcommand)
#   bash | python ...         that program, for debugging
#
# The server's own default host is 127.0.0.1, which nobody outside the container could
# reach, so `serve` always gets --host 0.0.0.0 first; a --host/--port given later on the
# command line still wins (the last occurrence of an option is the one argparse keeps).
set -eu

# Compose passes `PAGESTREAM_MODEL: ${PAGESTREAM_MODEL:-}` and the like, which sets the
# variable to "" when the operator left it out.  Empty must mean "not set" (embedded
# default model, no auth, no Redis), not "a model directory named ''".
for var in PAGESTREAM_MODEL PAGESTREAM_API_KEY PAGESTREAM_API_KEY_FILE PAGESTREAM_REDIS_URL \
    PAGESTREAM_ALLOWED_HOSTS; do
    eval "val=\${$var-}"
    if [ -z "$val" ]; then
        unset "$var"
    fi
done

case "${1-}" in
    "" | -*) set -- serve "$@" ;;
esac

if [ "$1" = serve ]; then
    shift
    # Keys come from PAGESTREAM_API_KEY, PAGESTREAM_API_KEY_FILE or --api-key[-file].
    if [ -z "${PAGESTREAM_API_KEY-}" ] && [ -z "${PAGESTREAM_API_KEY_FILE-}" ]; then
        case " $* " in
            *" --api-key"*) ;;
            *) echo "pagestream-entrypoint: PAGESTREAM_API_KEY is not set: the API accepts" \
                   "requests without a key" >&2 ;;
        esac
    fi
    # PAGESTREAM_EXTRA_ARGS: options for every replica from one compose variable, e.g.
    # "--dtype bfloat16 --max-num-seqs 64".  Split on whitespace on purpose (no quoting).
    # shellcheck disable=SC2086
    set -- pagestream serve --host 0.0.0.0 --port "${PAGESTREAM_PORT:-8000}" \
        ${PAGESTREAM_EXTRA_ARGS-} "$@"
elif ! command -v "$1" >/dev/null 2>&1; then
    # Not a program on PATH: a pagestream subcommand such as make-model.
    set -- pagestream "$@"
fi

# tcmalloc (Debian's libtcmalloc-minimal4, installed by the Dockerfile) under the server:
# a CPU prefill step frees and allocates tens of MB of activations per layer, which glibc
# hands back to the kernel and takes again as fresh zeroed pages; tcmalloc keeps them (its
# prefill steps measured ~5-10% faster on a 2-core Xeon).  An LD_PRELOAD already set wins.
if [ -z "${LD_PRELOAD-}" ]; then
    for lib in /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4; do
        if [ -e "$lib" ]; then
            export LD_PRELOAD="$lib"
        fi
    done
fi

# exec: the server replaces this shell, so tini's SIGTERM reaches it directly.
exec "$@"
