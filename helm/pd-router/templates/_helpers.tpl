{{/*
The picker's name (Deployment, Service, ServiceAccount, ConfigMap): <release>-epp, as the
reference chart names its endpoint picker.
*/}}
{{- define "pd-router.name" -}}
{{- printf "%s-epp" (.Release.Name | lower | trunc 40 | trimSuffix "-") -}}
{{- end -}}

{{/* The InferencePool is named after the release. */}}
{{- define "pd-router.poolName" -}}
{{- .Release.Name -}}
{{- end -}}

{{- define "pd-router.redisName" -}}
{{- printf "%s-redis" (include "pd-router.name" .) -}}
{{- end -}}

{{- define "pd-router.serviceAccountName" -}}
{{- .Values.serviceAccount.name | default (include "pd-router.name" .) -}}
{{- end -}}

{{- define "pd-router.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pd-router.labels" -}}
helm.sh/chart: {{ include "pd-router.chart" . }}
app.kubernetes.io/name: pd-router
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The picker's pods. */}}
{{- define "pd-router.selectorLabels" -}}
app.kubernetes.io/name: pd-router
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: endpoint-picker
{{- end -}}

{{- define "pd-router.redisSelectorLabels" -}}
app.kubernetes.io/name: pd-router
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end -}}

{{/* registry/repository:tag of an image block; the tag defaults to the chart's appVersion. */}}
{{- define "pd-router.image" -}}
{{- $image := .image -}}
{{- printf "%s/%s:%s" $image.registry $image.repository (toString ($image.tag | default .root.Chart.AppVersion)) -}}
{{- end -}}

{{- define "pd-router.tlsEnabled" -}}
{{- if .Values.inferenceExtension.tls.enabled }}true{{ end -}}
{{- end -}}

{{/* The external-scaler variant of KEDA: the picker serves KEDA's gRPC scaler on scalerPort. */}}
{{- define "pd-router.kedaExternal" -}}
{{- if and .Values.keda.enabled (has .Values.keda.trigger (list "external" "external-push")) }}true{{ end -}}
{{- end -}}

{{- define "pd-router.redisInternal" -}}
{{- if and .Values.redis.enabled (not .Values.redis.external.url) }}true{{ end -}}
{{- end -}}

{{- define "pd-router.redisPasswordFromSecret" -}}
{{- if and .Values.redis.enabled .Values.redis.external.url .Values.redis.external.passwordSecret.name }}true{{ end -}}
{{- end -}}

{{/* The Redis URL written into the pool config (never with a password in it). */}}
{{- define "pd-router.redisURL" -}}
{{- if .Values.redis.external.url -}}
{{- $url := .Values.redis.external.url -}}
{{- with .Values.redis.external.username -}}
{{- $url = regexReplaceAll "^(rediss?://)" $url (printf "${1}%s@" .) -}}
{{- end -}}
{{- $url -}}
{{- else -}}
{{- printf "redis://%s:6379/0" (include "pd-router.redisName" .) -}}
{{- end -}}
{{- end -}}

{{- define "pd-router.metricsTokenFromSecret" -}}
{{- if .Values.inferenceExtension.monitoring.prometheus.auth.enabled }}true{{ end -}}
{{- end -}}

{{/*
Secrets reach the picker as files it reads at start (pool config *_file fields), never as env
vars or arguments: one projected volume, mounted read-only at secretsDir, with a file per secret.
*/}}
{{- define "pd-router.secretsDir" -}}
/var/run/secrets/pd-router
{{- end -}}

{{- define "pd-router.redisPasswordFile" -}}
{{- printf "%s/redis/password" (include "pd-router.secretsDir" .) -}}
{{- end -}}

{{- define "pd-router.metricsTokenFile" -}}
{{- printf "%s/metrics/token" (include "pd-router.secretsDir" .) -}}
{{- end -}}

{{- define "pd-router.secretFiles" -}}
{{- if or (include "pd-router.redisPasswordFromSecret" .) (include "pd-router.metricsTokenFromSecret" .) }}true{{ end -}}
{{- end -}}

{{/* metricType of a KEDA trigger: given, or AverageValue for recommendedReplicas, else Value. */}}
{{- define "pd-router.kedaMetricType" -}}
{{- if .role.metricType -}}
{{- .role.metricType -}}
{{- else if or (eq .role.signal "recommendedReplicas") (and (eq .trigger "prometheus") (not .role.query)) -}}
AverageValue
{{- else -}}
Value
{{- end -}}
{{- end -}}

{{/*
The resource name (plural) of a workload kind, for the scale subresource rule:
Deployment -> deployments, LeaderWorkerSet -> leaderworkersets.
*/}}
{{- define "pd-router.plural" -}}
{{- $kind := lower . -}}
{{- if hasSuffix "s" $kind -}}{{ $kind }}es{{- else -}}{{ $kind }}s{{- end -}}
{{- end -}}

{{/*
The chart's part of the pool configuration: the listeners, discovery and shared index. It is
merged over inferenceExtension.poolConfig (these keys win).
*/}}
{{- define "pd-router.ownedConfig" -}}
{{- $ie := .Values.inferenceExtension -}}
proxy:
  enabled: false
extproc:
  enabled: true
  host: 0.0.0.0
  port: {{ $ie.extProcPort }}
  health_port: {{ $ie.grpcHealthPort }}
  tls:
    enabled: {{ $ie.tls.enabled }}
    {{- if $ie.tls.enabled }}
    accept_cleartext: {{ $ie.tls.acceptCleartext }}
    min_version: {{ $ie.tls.minVersion | quote }}
    {{- with $ie.tls.secretName }}
    cert_file: /etc/pd-router/tls/tls.crt
    key_file: /etc/pd-router/tls/tls.key
    {{- end }}
    {{- end }}
metrics:
  enabled: true
  host: 0.0.0.0
  port: {{ $ie.metricsPort }}
  {{- if include "pd-router.metricsTokenFromSecret" . }}
  token_file: {{ include "pd-router.metricsTokenFile" . }}
  {{- end }}
kubernetes:
  namespace: {{ .Release.Namespace }}
  pool_name: {{ include "pd-router.poolName" . }}
{{- if include "pd-router.kedaExternal" . }}
keda:
  enabled: true
  host: 0.0.0.0
  port: {{ .Values.keda.scalerPort }}
{{- end }}
{{- if .Values.redis.enabled }}
index:
  redis:
    url: {{ include "pd-router.redisURL" . | quote }}
    {{- if include "pd-router.redisPasswordFromSecret" . }}
    password_file: {{ include "pd-router.redisPasswordFile" . }}
    {{- end }}
{{- end }}
{{- end -}}

{{/* The pool configuration file, as the ConfigMap holds it. */}}
{{- define "pd-router.poolConfigYaml" -}}
{{- $user := deepCopy (.Values.inferenceExtension.poolConfig | default dict) -}}
{{- $owned := include "pd-router.ownedConfig" . | fromYaml -}}
{{- toYaml (mustMergeOverwrite $user $owned) -}}
{{- end -}}

{{/*
The decode-side P/D sidecar container (`pd-router sidecar`), for the decode workload's pod spec:
  containers:
    {{- include "pd-router.decodeSidecar" . | nindent 4 }}
*/}}
{{- define "pd-router.decodeSidecar" -}}
{{- $sc := .Values.decodeSidecar -}}
{{- $image := mergeOverwrite (deepCopy .Values.inferenceExtension.image) ($sc.image | default dict) -}}
- name: {{ $sc.name }}
  image: {{ include "pd-router.image" (dict "image" $image "root" .) }}
  imagePullPolicy: {{ $image.pullPolicy }}
  args:
    - sidecar
    - --decode
    - 127.0.0.1:{{ $sc.vllmPort }}
    - --host
    - 0.0.0.0
    - --port
    - {{ $sc.port | quote }}
    {{- range $sc.allow }}
    - --allow
    - {{ . | quote }}
    {{- end }}
    {{- range $sc.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  {{- /* the picker reads this port name: pairs end only on pods a sidecar fronts (extproc.pd_pairs) */}}
  ports:
    - name: pd-sidecar
      containerPort: {{ $sc.port }}
      protocol: TCP
  readinessProbe:
    httpGet:
      path: /health
      port: {{ $sc.port }}
    periodSeconds: 5
    failureThreshold: 3
  {{- with $sc.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- /* its own user: decode pods often run vLLM as root at the pod level */}}
  securityContext:
    {{- toYaml (mustMergeOverwrite (dict "runAsUser" 65532 "runAsGroup" 65532) (deepCopy .Values.inferenceExtension.securityContext)) | nindent 4 }}
{{- end -}}

{{/* Checks the schema cannot express; a failure names the value to set. */}}
{{- define "pd-router.validate" -}}
{{- $ie := .Values.inferenceExtension -}}
{{- if not .Values.inferencePool.modelServers.matchLabels -}}
{{- fail "inferencePool.modelServers.matchLabels is required: the labels of the model-server pods, e.g. --set inferencePool.modelServers.matchLabels.app=vllm-qwen" -}}
{{- end -}}
{{- if not ($ie.poolConfig | default dict).model -}}
{{- fail "inferenceExtension.poolConfig.model is required: the served model name, e.g. --set inferenceExtension.poolConfig.model=Qwen/Qwen3-32B" -}}
{{- end -}}
{{- $ports := list -}}
{{- range .Values.inferencePool.targetPorts }}{{ $ports = append $ports (int .number) }}{{ end -}}
{{- if ne (len $ports) (len (uniq $ports)) -}}
{{- fail (printf "inferencePool.targetPorts: port numbers must be unique, got %v" $ports) -}}
{{- end -}}
{{- $listeners := list (int $ie.extProcPort) (int $ie.grpcHealthPort) (int $ie.metricsPort) -}}
{{- if include "pd-router.kedaExternal" . }}{{ $listeners = append $listeners (int .Values.keda.scalerPort) }}{{ end -}}
{{- if ne (len $listeners) (len (uniq $listeners)) -}}
{{- fail (printf "inferenceExtension.extProcPort, grpcHealthPort, metricsPort and keda.scalerPort must differ, got %v" $listeners) -}}
{{- end -}}
{{- if and $ie.tls.secretName (not $ie.tls.enabled) -}}
{{- fail "inferenceExtension.tls.secretName is set but inferenceExtension.tls.enabled is false" -}}
{{- end -}}
{{- if and $ie.monitoring.prometheus.auth.enabled (not $ie.monitoring.prometheus.auth.secretName) -}}
{{- fail "inferenceExtension.monitoring.prometheus.auth.enabled needs auth.secretName (a Secret with the key token)" -}}
{{- end -}}
{{- if and $ie.monitoring.prometheus.auth.enabled (dig "metrics" "token" "" ($ie.poolConfig | default dict)) -}}
{{- fail "inferenceExtension.monitoring.prometheus.auth.enabled and inferenceExtension.poolConfig.metrics.token are both set: the picker takes one token for /metrics (auth's Secret, as metrics.token_file); unset poolConfig.metrics.token" -}}
{{- end -}}
{{- if .Values.decodeSidecar.enabled -}}
{{- if not .Values.decodeSidecar.allow -}}
{{- fail "decodeSidecar.allow is required: the CIDRs (or IPs) of the prefill pods the sidecar may contact" -}}
{{- end -}}
{{- if not (has (int .Values.decodeSidecar.port) $ports) -}}
{{- fail (printf "decodeSidecar.port %v must be one of inferencePool.targetPorts %v: the InferencePool targets the sidecar, which forwards to vLLM on decodeSidecar.vllmPort" .Values.decodeSidecar.port $ports) -}}
{{- end -}}
{{- if eq (int .Values.decodeSidecar.port) (int .Values.decodeSidecar.vllmPort) -}}
{{- fail "decodeSidecar.port and decodeSidecar.vllmPort must differ: the sidecar listens on port, vLLM on vllmPort" -}}
{{- end -}}
{{- end -}}
{{- if and .Values.redis.enabled .Values.redis.external.passwordSecret.name (not .Values.redis.external.url) -}}
{{- fail "redis.external.passwordSecret is set but redis.external.url is empty (the in-chart Redis has no password)" -}}
{{- end -}}
{{- if .Values.keda.enabled -}}
{{- $roles := list -}}
{{- range $role := list "prefill" "decode" -}}
{{- if (index $.Values.keda $role).enabled -}}
{{- $roles = append $roles $role -}}
{{- if not (index $.Values.workloads $role).name -}}
{{- fail (printf "keda.%s is enabled but workloads.%s.name is empty: name the %s workload to scale (or set keda.%s.enabled=false)" $role $role $role $role) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if not $roles -}}
{{- fail "keda.enabled but neither keda.prefill.enabled nor keda.decode.enabled" -}}
{{- end -}}
{{- end -}}
{{- end -}}
