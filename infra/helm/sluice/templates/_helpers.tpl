{{/* Names and labels. */}}
{{- define "sluice.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sluice.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "sluice.labels" -}}
app.kubernetes.io/name: {{ include "sluice.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "sluice.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "sluice.databaseSecret" -}}
{{- if .Values.database.existingSecret -}}
{{- .Values.database.existingSecret -}}
{{- else -}}
{{- printf "%s-database" (include "sluice.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/*
sluice.workers: one entry per (pool, model) pair, the pool's settings merged
with the model entry's overrides, validated. Rendered as JSON for fromJson:
  {"items": [{"name", "pool", "model", "tp", "gpusPerPod", "replicas", ...}]}
*/}}
{{- define "sluice.workers" -}}
{{- $root := . -}}
{{- $partitions := dict -}}
{{- range .Values.models -}}
{{- $_ := set $partitions .name (int .partitions) -}}
{{- end -}}
{{- $items := list -}}
{{- $seen := dict -}}
{{- range $pool := .Values.pools -}}
{{- if not (regexMatch "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$" (toString $pool.name)) -}}
{{- fail (printf "pool name %q is not valid (SLUICE_POOL pattern)" (toString $pool.name)) -}}
{{- end -}}
{{- range $entry := $pool.models -}}
{{- $override := ternary (dict "name" $entry) $entry (kindIs "string" $entry) -}}
{{- $base := omit (deepCopy $pool) "models" "name" -}}
{{- $w := mergeOverwrite $base (omit (deepCopy $override) "name") -}}
{{- $model := toString $override.name -}}
{{- if not (hasKey $partitions $model) -}}
{{- fail (printf "pool %s places model %q, which is missing from .Values.models" $pool.name $model) -}}
{{- end -}}
{{- $tp := int ($w.tp | default 1) -}}
{{- $gpus := int ($w.gpusPerPod | default $tp) -}}
{{- if lt $gpus $tp -}}
{{- fail (printf "%s/%s: gpusPerPod (%d) is less than tp (%d)" $pool.name $model $gpus $tp) -}}
{{- end -}}
{{- $min := int $w.replicas.min -}}
{{- $max := int $w.replicas.max -}}
{{- if or (lt $max 1) (lt $max $min) -}}
{{- fail (printf "%s/%s: replicas.max (%d) must be >= 1 and >= replicas.min (%d)" $pool.name $model $max $min) -}}
{{- end -}}
{{- if gt $max (get $partitions $model) -}}
{{- fail (printf "%s/%s: replicas.max (%d) exceeds the %d partitions of the request topic; extra replicas would sit idle" $pool.name $model $max (get $partitions $model)) -}}
{{- end -}}
{{- $raw := printf "%s-%s-%s" (include "sluice.fullname" $root) $pool.name $model | lower -}}
{{- $name := regexReplaceAll "[^a-z0-9-]" $raw "-" | trunc 63 | trimSuffix "-" -}}
{{- if hasKey $seen $name -}}
{{- fail (printf "two workers render to the same name %s" $name) -}}
{{- end -}}
{{- $_ := set $seen $name true -}}
{{- $_ := set $w "name" $name -}}
{{- $_ := set $w "pool" (toString $pool.name) -}}
{{- $_ := set $w "model" $model -}}
{{- $_ := set $w "tp" $tp -}}
{{- $_ := set $w "gpusPerPod" $gpus -}}
{{- $_ := set $w "minReplicas" $min -}}
{{- $_ := set $w "maxReplicas" $max -}}
{{- $items = append $items $w -}}
{{- end -}}
{{- end -}}
{{- dict "items" $items | toJson -}}
{{- end -}}

{{/* The workload kind of every worker: StatefulSet (stable member ids) or Deployment. */}}
{{- define "sluice.workerKind" -}}
{{- $kind := .Values.worker.kind | default "StatefulSet" -}}
{{- if not (has $kind (list "StatefulSet" "Deployment")) -}}
{{- fail (printf "worker.kind %q is not StatefulSet or Deployment" (toString $kind)) -}}
{{- end -}}
{{- $kind -}}
{{- end -}}

{{/* Labels telling one (pool, model) worker from another; call with (dict "root" $ "w" $worker). */}}
{{- define "sluice.workerLabels" -}}
app.kubernetes.io/component: worker
sluice.dev/pool: {{ .w.pool | quote }}
sluice.dev/model: {{ .w.model | quote }}
{{- end -}}

{{- define "sluice.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sluice.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{ include "sluice.workerLabels" . }}
{{- end -}}
