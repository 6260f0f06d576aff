{{/*
A `helm test` pod: runs `script` (Python, in gpupack's image) and passes when it exits 0. Meets Pod
Security "restricted"; no API token; retries for up to a minute so that a test right after an
install or upgrade waits for the rollout.
*/}}
{{- define "gpupack.testPod" -}}
apiVersion: v1
kind: Pod
metadata:
  name: {{ .name }}
  namespace: {{ .ctx.Release.Namespace }}
  labels:
    {{- include "gpupack.labels" .ctx | nindent 4 }}
    app.kubernetes.io/name: gpupack-helm-test
  annotations:
    helm.sh/hook: test
    helm.sh/hook-delete-policy: before-hook-creation
spec:
  restartPolicy: Never
  automountServiceAccountToken: false
  {{- with .ctx.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    runAsNonRoot: true
    runAsUser: 65532
    runAsGroup: 65532
    seccompProfile:
      type: RuntimeDefault
  containers:
    - name: check
      image: {{ include "gpupack.image" .ctx }}
      imagePullPolicy: {{ .ctx.Values.image.pullPolicy }}
      command: [python, -c]
      args:
        - |
          import ssl, sys, time, urllib.request
          url = {{ .url | quote }}
          ctx = {{ if .ca }}ssl.create_default_context(cafile={{ .ca | quote }}){{ else }}None{{ end }}
          for attempt in range(30):
              try:
                  with urllib.request.urlopen(url, context=ctx, timeout=5) as r:
                      print(url, r.status, r.read(200).decode(errors="replace"))
                      sys.exit(0)
              except Exception as e:  # not up yet, refused, or a certificate the CA does not vouch for
                  print(url, "attempt", attempt + 1, e, flush=True)
                  time.sleep(2)
          sys.exit(1)
      resources:
        requests: {cpu: 10m, memory: 32Mi}
        limits: {cpu: 100m, memory: 64Mi}
      securityContext:
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        capabilities:
          drop: [ALL]
      {{- if .ca }}
      volumeMounts:
        - name: webhook-ca
          mountPath: /ca
          readOnly: true
  volumes:
    # the CA alone (not its key, not the serving key) from the webhook's certificate Secret
    - name: webhook-ca
      secret:
        secretName: {{ .ctx.Values.webhook.certificates.secretName }}
        items:
          - key: ca.crt
            path: ca.crt
      {{- end }}
{{- end -}}
