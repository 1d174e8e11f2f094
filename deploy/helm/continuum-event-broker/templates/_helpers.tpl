{{/* Names and labels shared by every template. */}}
{{- define "continuum-event-broker.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "continuum-event-broker.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "continuum-event-broker.labels" -}}
{{ include "continuum-event-broker.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "continuum-event-broker.serviceAccountName" -}}
{{- default (include "continuum-event-broker.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "continuum-event-broker.tokenSecret" -}}
{{- default (printf "%s-token" (include "continuum-event-broker.fullname" .)) .Values.token.existingSecret -}}
{{- end -}}

{{- define "continuum-event-broker.caConfigMap" -}}
{{- default (printf "%s-ca" (include "continuum-event-broker.fullname" .)) .Values.ca.existingConfigMap -}}
{{- end -}}

{{/* Refuses a role the chart does not know, and a kv_listener without sources. */}}
{{- define "continuum-event-broker.checkRole" -}}
{{- if not (has .Values.role (list "broker" "kv_listener")) -}}
{{- fail (printf "role must be broker or kv_listener, not %q" .Values.role) -}}
{{- end -}}
{{- if and (eq .Values.role "kv_listener") (not .Values.kvListener.sources) -}}
{{- fail "role kv_listener needs kvListener.sources (BACKEND=PUBLISHER_ID@tcp://HOST:PORT)" -}}
{{- end -}}
{{- end -}}
