{{/* Names */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels on every object; selectorLabels pick this release's pods */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Per component: router (Ray head), prefill, decode, redis */}}
{{- define "tandem.componentSelector" -}}
{{ include "tandem.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tandem.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}
{{- end -}}

{{- define "tandem.secretName" -}}
{{ include "tandem.fullname" . }}-secrets
{{- end -}}

{{- define "tandem.redisName" -}}
{{ include "tandem.fullname" . }}-redis
{{- end -}}

{{/* A value from the chart's Secret or from an existing one: (dict "root" $ "value" v "existing" e "key" k) */}}
{{- define "tandem.secretRef" -}}
{{- if .existing.name -}}
secretKeyRef: {name: {{ .existing.name | quote }}, key: {{ .existing.key | quote }}}
{{- else -}}
secretKeyRef: {name: {{ include "tandem.secretName" .root | quote }}, key: {{ .key | quote }}}
{{- end -}}
{{- end -}}

{{/* A generated secret value that survives upgrades: the one already in the chart's Secret, else random */}}
{{- define "tandem.generated" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace (include "tandem.secretName" .root) -}}
{{- if and $existing (hasKey $existing.data .key) -}}
{{- index $existing.data .key | b64dec -}}
{{- else -}}
{{- randAlphaNum 48 -}}
{{- end -}}
{{- end -}}

{{- define "tandem.redisPasswordRef" -}}
{{ include "tandem.secretRef" (dict "root" . "existing" .Values.redis.existingSecret "key" "redis-password") }}
{{- end -}}

{{/* Does the Redis URL carry a password? */}}
{{- define "tandem.redisAuth" -}}
{{- if or (eq .Values.redis.mode "bundled") .Values.redis.external.auth -}}true{{- end -}}
{{- end -}}

{{/* The redis URL; $(REDIS_PASSWORD) is expanded by Kubernetes from the variable before it */}}
{{- define "tandem.redisUrl" -}}
{{- $auth := ternary ":$(REDIS_PASSWORD)@" "" (eq (include "tandem.redisAuth" .) "true") -}}
{{- if eq .Values.redis.mode "bundled" -}}
redis://{{ $auth }}{{ include "tandem.redisName" . }}:6379/0
{{- else -}}
{{- $scheme := ternary "rediss" "redis" .Values.redis.external.tls -}}
{{ $scheme }}://{{ $auth }}{{ required "redis.external.host is required when redis.mode is external" .Values.redis.external.host }}:{{ .Values.redis.external.port }}/{{ .Values.redis.external.database }}
{{- end -}}
{{- end -}}

{{/* Environment every Ray container (head and workers) needs */}}
{{- define "tandem.rayEnv" -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    {{- include "tandem.secretRef" (dict "root" . "existing" .Values.secrets.rayAuthTokenExistingSecret "key" "ray-auth-token") | nindent 4 }}
# Ray would start worker processes at niceness 15, below everything else on the node
- name: RAY_worker_niceness
  value: "0"
# the root filesystem is read-only: caches go to /tmp (an emptyDir)
- name: HOME
  value: /tmp/home
- name: XDG_CACHE_HOME
  value: /tmp/cache
{{- if .Values.model.cacheClaim }}
- name: TANDEM_CACHE_DIR
  value: /models
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Volumes every Ray pod mounts: /tmp, /dev/shm (Ray's object store), the model cache */}}
{{- define "tandem.volumes" -}}
- name: tmp
  emptyDir: {}
- name: shm
  emptyDir: {medium: Memory, sizeLimit: {{ .shmSize }}}
{{- if .root.Values.model.cacheClaim }}
- name: models
  persistentVolumeClaim: {claimName: {{ .root.Values.model.cacheClaim | quote }}}
{{- end }}
{{- end -}}

{{- define "tandem.volumeMounts" -}}
- {name: tmp, mountPath: /tmp}
- {name: shm, mountPath: /dev/shm}
{{- if .Values.model.cacheClaim }}
- {name: models, mountPath: /models}
{{- end }}
{{- end -}}

{{/* resources with GPUs: requests equal limits */}}
{{- define "tandem.resources" -}}
{{- $resources := deepCopy .resources -}}
{{- if gt (int .gpus) 0 -}}
{{- $_ := set $resources "requests" (merge (dict "nvidia.com/gpu" (toString .gpus)) (default (dict) $resources.requests)) -}}
{{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" (toString .gpus)) (default (dict) $resources.limits)) -}}
{{- end -}}
{{ toYaml $resources }}
{{- end -}}
