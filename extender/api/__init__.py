"""The extender's edges, below every other layer: the calls it makes to the Kubernetes API
(`kube`), the extender/v1 JSON it reads and writes (`wire`), and the one-writer Lease fence
(`lease`). Nothing here knows the view."""
