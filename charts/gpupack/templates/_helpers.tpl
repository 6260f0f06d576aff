{{/*
Labels of every object: what `kubectl apply -k deploy/` sets (part-of) and Helm's own.
*/}}
{{- define "gpupack.labels" -}}
app.kubernetes.io/part-of: gpupack
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{/*
gpupack's image: repository@digest, else repository:tag (tag default: the chart's appVersion).
*/}}
{{- define "gpupack.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/*
kube-scheduler's image: the cluster's own version unless a tag is given. A kube-scheduler newer
than the API server is unsupported; a provider suffix (v1.30.4-eks-a737599, v1.29.6-gke.100) is
cut to the upstream release the image is published as.
*/}}
{{- define "gpupack.schedulerImage" -}}
{{- $tag := .Values.scheduler.image.tag -}}
{{- if not $tag -}}
{{- $tag = regexFind "^v?[0-9]+\\.[0-9]+\\.[0-9]+" .Capabilities.KubeVersion.Version -}}
{{- if not $tag -}}
{{- fail (printf "cannot read the cluster's version from %q: set scheduler.image.tag" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- $tag = printf "v%s" (trimPrefix "v" $tag) -}}
{{- end -}}
{{ .Values.scheduler.image.repository }}:{{ $tag }}
{{- end -}}

{{/*
A ServiceAccount's user name as the API server writes it in an admission request.
*/}}
{{- define "gpupack.user" -}}
system:serviceaccount:{{ .ctx.Release.Namespace }}:{{ .name }}
{{- end -}}

{{/*
The ValidatingAdmissionPolicy API version: the value's, else what the server serves (v1, else
v1beta1); offline (`helm template` without --api-versions) v1 from Kubernetes 1.30, where it is
on by default. Before 1.30 with neither served: stop, saying what to do.
*/}}
{{- define "gpupack.policyApiVersion" -}}
{{- $api := .Values.admissionPolicies.apiVersion -}}
{{- $group := "admissionregistration.k8s.io" -}}
{{- if $api -}}
{{ $api }}
{{- else if .Capabilities.APIVersions.Has (printf "%s/v1/ValidatingAdmissionPolicy" $group) -}}
{{ $group }}/v1
{{- else if .Capabilities.APIVersions.Has (printf "%s/v1beta1/ValidatingAdmissionPolicy" $group) -}}
{{ $group }}/v1beta1
{{- else if semverCompare ">=1.30.0-0" .Capabilities.KubeVersion.Version -}}
{{ $group }}/v1
{{- else -}}
{{- fail (printf "Kubernetes %s serves no ValidatingAdmissionPolicy API: turn it on (feature gate ValidatingAdmissionPolicy=true and --runtime-config=%s/v1beta1=true on the API server), or set admissionPolicies.enabled=false (the validating webhook state.pods.gpupack.io still guards pods' gpupack state)" .Capabilities.KubeVersion.Version $group) -}}
{{- end -}}
{{- end -}}

{{/*
GPUPACK_LOG_* env entries of a gpupack container (none with the defaults).
*/}}
{{- define "gpupack.logEnv" -}}
{{- if .Values.logFormat }}
- name: GPUPACK_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
{{- end }}
{{- if .Values.logLevel }}
- name: GPUPACK_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
{{- end }}
{{- end -}}

{{/*
Seconds of a Go duration ("15s", "1m30s"), as text (`| float64` to compute with it).
*/}}
{{- define "gpupack.durationSeconds" -}}
{{- $total := 0.0 -}}
{{- $units := dict "ns" 1e-9 "us" 1e-6 "ms" 0.001 "s" 1.0 "m" 60.0 "h" 3600.0 -}}
{{- range regexFindAll "[0-9]+(\\.[0-9]+)?(ns|us|ms|s|m|h)" . -1 -}}
{{- $n := regexFind "^[0-9.]+" . -}}
{{- $total = addf $total (mulf ($n | float64) (get $units (trimPrefix $n .))) -}}
{{- end -}}
{{- $total -}}
{{- end -}}

{{/*
DRA mode (devicePlugin.mode=dra) needs resource.k8s.io/v1 (Kubernetes 1.34 and later): what the
server serves, else (offline, `helm template` without --api-versions) the version asked for. On an
older cluster the install stops and says what to do instead.
*/}}
{{- define "gpupack.draCheck" -}}
{{- if not (or (.Capabilities.APIVersions.Has "resource.k8s.io/v1") (semverCompare ">=1.34.0-0" .Capabilities.KubeVersion.Version)) -}}
{{- fail (printf "devicePlugin.mode=dra needs Dynamic Resource Allocation at resource.k8s.io/v1 (Kubernetes 1.34 or later), which Kubernetes %s does not serve: set devicePlugin.mode=device-plugin (pods then ask gpupack.io/gpu-mem and gpupack.io/gpu-sm)" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- end -}}

{{/*
gpupack allocating DRA claims (devicePlugin.dra.allocate) gates pods with a MutatingAdmissionPolicy
at admissionregistration.k8s.io/v1 (Kubernetes 1.36): what the server serves, else (offline) the
version asked for.
*/}}
{{- define "gpupack.draAllocateCheck" -}}
{{- if not (or (.Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy") (semverCompare ">=1.36.0-0" .Capabilities.KubeVersion.Version)) -}}
{{- fail (printf "devicePlugin.dra.allocate=true gates pods with a MutatingAdmissionPolicy (admissionregistration.k8s.io/v1, Kubernetes 1.36 or later), which Kubernetes %s does not serve: set devicePlugin.dra.allocate=false (kube-scheduler's own allocator then places the claims)" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- end -}}
