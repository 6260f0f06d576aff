"""kube-scheduler's verbs over the view: filter, prioritize and bind (`framework.Extender` wires
them), the caches and passes that serve them (fitting, scoring, answers, sampling, warming), and
the bind's follow-ups (settling, stale assignments, upkeep). Imports `extender.state` and below."""
