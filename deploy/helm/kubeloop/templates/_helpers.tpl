{{/* An image reference from one of the values' image blocks: (list $ .Values.image). The global
     registry, when set, goes in front of the repository. */}}
{{- define "kubeloop.imageRef" -}}
{{- $root := index . 0 }}{{- $image := index . 1 }}
{{- with $root.Values.registry }}{{ trimSuffix "/" . }}/{{ end }}{{ $image.repository }}:{{ $image.tag }}
{{- end }}

{{/* The kubeloop image every kubeloop container runs. */}}
{{- define "kubeloop.image" -}}
{{ include "kubeloop.imageRef" (list . .Values.image) }}
{{- end }}

{{/* external-snapshot-metadata's sidecar. */}}
{{- define "kubeloop.snapshotMetadataImage" -}}
{{ include "kubeloop.imageRef" (list . .Values.snapshotMetadata.image) }}
{{- end }}

{{/* external-snapshotter's csi-snapshotter sidecar. */}}
{{- define "kubeloop.snapshotterImage" -}}
{{ include "kubeloop.imageRef" (list . .Values.snapshotter.image) }}
{{- end }}

{{/* external-snapshotter's snapshot-controller. */}}
{{- define "kubeloop.snapshotControllerImage" -}}
{{ include "kubeloop.imageRef" (list . .Values.snapshots.controller.image) }}
{{- end }}

{{/* kubelet's root directory, without a trailing slash. */}}
{{- define "kubeloop.kubeletDir" -}}
{{ clean .Values.kubeletDir }}
{{- end }}

{{/* A scalar value as the text a flag or a StorageClass parameter takes: YAML numbers reach the
     templates as floats, which print as 1.073741824e+09; a whole one prints as digits. */}}
{{- define "kubeloop.text" -}}
{{- if and (kindIs "float64" .) (eq (float64 (int64 .)) .) }}{{ int64 . }}{{ else }}{{ toString . }}{{ end }}
{{- end }}

{{/* Where a pod runs, and what it pulls with: (list $ .Values.node) or (list $ .Values.controller).
     Pod spec fields, to be indented under spec. */}}
{{- define "kubeloop.placement" -}}
{{- $root := index . 0 }}{{- $where := index . 1 }}
{{- with $where.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $where.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $where.affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $where.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ if kindIs "string" . }}{{ . }}{{ else }}{{ .name }}{{ end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The driver's --capacity values for one node of node-local mode (or the shared controller):
     (list $ <size or kind map or nil>): a list of "SIZE" or "KIND=SIZE", kinds sorted, each
     kind's size from the node's map when it names it, else from poolKinds. */}}
{{- define "kubeloop.capacityArgs" -}}
{{- $root := index . 0 }}{{- $own := index . 1 }}
{{- $out := list }}
{{- if $root.Values.poolKinds }}
{{- $sizes := merge (deepCopy ($own | default dict)) $root.Values.poolKinds }}
{{- range $kind := keys $sizes | sortAlpha }}
{{- $out = append $out (printf "%s=%s" $kind (include "kubeloop.text" (get $sizes $kind))) }}
{{- end }}
{{- else if $own }}
{{- $out = append $out (include "kubeloop.text" $own) }}
{{- else if $root.Values.capacity }}
{{- $out = append $out (include "kubeloop.text" $root.Values.capacity) }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* capacityPerNode as the driver's --capacity-per-node file: node name to its --capacity values. */}}
{{- define "kubeloop.capacityPerNode" -}}
{{- $root := . }}
{{- $table := dict }}
{{- range $node, $own := .Values.capacityPerNode }}
{{- $_ := set $table $node (include "kubeloop.capacityArgs" (list $root $own) | fromJsonArray) }}
{{- end }}
{{- toJson $table }}
{{- end }}
