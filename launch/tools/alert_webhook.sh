#!/bin/sh
# Example alert hook: posts each spike-guard alert to a Slack-compatible incoming webhook
# ({"text": ...}). keel-train runs alert.command through /bin/sh -c with the alert's JSON line
# on stdin (docs/alerts.md), so:
#   export KEEL_ALERT_WEBHOOK_URL=https://hooks.slack.com/services/...
#   keel-train cfg.pbtxt --set alert.command=$PWD/launch/tools/alert_webhook.sh
# Needs python3 (builds the payload, no jq) and curl. The URL reaches curl through its config
# on stdin, not its argv, so `ps` does not show the webhook's secret. Exits 2 when the URL is
# unset or stdin is not an alert, and with curl's code when the post fails (keel-train logs the
# code); KEEL_ALERT_WEBHOOK_MAX_TIME_S (default 10) bounds the post.
set -eu

if [ -z "${KEEL_ALERT_WEBHOOK_URL:-}" ]; then
  echo "alert_webhook.sh: KEEL_ALERT_WEBHOOK_URL is not set; alert not posted" >&2
  exit 2
fi
case "$KEEL_ALERT_WEBHOOK_URL" in
  *'"'* | *\\*)
    echo "alert_webhook.sh: KEEL_ALERT_WEBHOOK_URL contains a quote or backslash" >&2
    exit 2
    ;;
esac

payload=$(mktemp "${TMPDIR:-/tmp}/keel_alert.XXXXXX")
trap 'rm -f "$payload"' EXIT

python3 -c '
import json, socket, sys

def num(v):
    return "-" if v is None else "%.4g" % v

try:
    a = json.loads(sys.stdin.readline())
    text = "keel-train on %s: ALERT step %s [%s -> %s]: %s (loss %s, baseline %s, threshold %s, grad norm %s)" % (
        socket.gethostname(), a["step"], a["kind"], a["action"], a["message"],
        num(a["loss"]), num(a["baseline"]), num(a["threshold"]), num(a["grad_norm"]))
    if a.get("checkpoint"):
        text += "; restored " + a["checkpoint"]
except (ValueError, KeyError, TypeError) as e:
    sys.exit("alert_webhook.sh: stdin is not a keel alert line: %s" % e)
json.dump({"text": text}, sys.stdout)
' >"$payload" || exit 2

printf 'url = "%s"\n' "$KEEL_ALERT_WEBHOOK_URL" |
  curl --silent --show-error --fail --max-time "${KEEL_ALERT_WEBHOOK_MAX_TIME_S:-10}" \
    --config - --header 'Content-Type: application/json' --data-binary "@$payload" --output /dev/null
