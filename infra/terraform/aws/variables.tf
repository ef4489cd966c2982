################################################################################
# Naming
################################################################################

variable "name" {
  description = "Name of the deployment: used for the Lambda function, its IAM role, log group and SSM parameter."
  type        = string
  default     = "kvgate"

  validation {
    condition     = can(regex("^[a-zA-Z0-9-_]{1,48}$", var.name))
    error_message = "name must be 1-48 characters of letters, digits, '-' or '_' (it prefixes IAM and Lambda names)."
  }
}

variable "tags" {
  description = "Tags added to every resource that supports them."
  type        = map(string)
  default     = {}
}

################################################################################
# Bucket
################################################################################

variable "bucket_name" {
  description = "Name of the S3 bucket holding KV chunk objects. When null, a unique name is generated from `name`."
  type        = string
  default     = null

  validation {
    condition     = var.bucket_name == null || can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.bucket_name))
    error_message = "bucket_name must be a valid S3 bucket name (3-63 lowercase letters, digits, '.' or '-')."
  }
}

variable "force_destroy" {
  description = "Allow `terraform destroy` to delete a bucket that still holds objects (the cache is reproducible, but keep false in production)."
  type        = bool
  default     = false
}

variable "object_prefix" {
  description = "Key prefix under which the gateway stores chunk objects (`<prefix>/<namespace-id>/<xx>/<key>`). Lifecycle rules and IAM are scoped to it."
  type        = string
  default     = "kv"

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9._-]{0,62}$", var.object_prefix))
    error_message = "object_prefix must be 1-63 characters of lowercase letters, digits, '.', '_' or '-', without slashes."
  }
}

variable "kms_key_arn" {
  description = "ARN of a customer-managed KMS key for SSE-KMS. When null the bucket uses SSE-S3 (AES256), which costs nothing per request."
  type        = string
  default     = null

  validation {
    condition     = var.kms_key_arn == null || can(regex("^arn:aws[a-z-]*:kms:[a-z0-9-]+:[0-9]{12}:key/.+$", var.kms_key_arn))
    error_message = "kms_key_arn must be a KMS key ARN (arn:aws:kms:<region>:<account>:key/<id>)."
  }
}

################################################################################
# Cold tier lifecycle
################################################################################

variable "cold_tier_transition_days" {
  description = "Days after creation when chunk objects move to `cold_tier_storage_class`. Null keeps them in S3 Standard. 0 (INTELLIGENT_TIERING only) puts objects there from the first lifecycle run."
  type        = number
  default     = 30

  validation {
    condition     = var.cold_tier_transition_days == null || try(var.cold_tier_transition_days >= 0 && floor(var.cold_tier_transition_days) == var.cold_tier_transition_days, false)
    error_message = "cold_tier_transition_days must be a whole number of days >= 0, or null."
  }
}

variable "cold_tier_storage_class" {
  description = "Storage class for the cold tier. INTELLIGENT_TIERING (with transition days 0) suits gc's retention by last use: a chunk not read for 30 days drops to the infrequent tier by itself, a read brings it back, no retrieval fee. STANDARD_IA and ONEZONE_IA need >= 30 days and bill 30 days minimum per object; GLACIER_IR keeps millisecond reads."
  type        = string
  default     = "STANDARD_IA"

  validation {
    condition     = contains(["STANDARD_IA", "ONEZONE_IA", "INTELLIGENT_TIERING", "GLACIER_IR"], var.cold_tier_storage_class)
    error_message = "cold_tier_storage_class must be one of STANDARD_IA, ONEZONE_IA, INTELLIGENT_TIERING, GLACIER_IR (classes that still serve GETs directly)."
  }

  validation {
    condition     = !contains(["STANDARD_IA", "ONEZONE_IA"], var.cold_tier_storage_class) || var.cold_tier_transition_days == null || try(var.cold_tier_transition_days >= 30, false)
    error_message = "S3 refuses transitions to STANDARD_IA / ONEZONE_IA earlier than 30 days after creation."
  }

  validation {
    condition     = var.cold_tier_transition_days != 0 || var.cold_tier_storage_class == "INTELLIGENT_TIERING"
    error_message = "cold_tier_transition_days = 0 is only for INTELLIGENT_TIERING (its access tiers follow reads; other classes charge for early reads and deletes)."
  }
}

variable "expiration_days" {
  description = "Days after creation when chunk objects are deleted. Null keeps them forever. KV is recomputable, so expiring bounds the bill."
  type        = number
  default     = 180

  validation {
    condition     = var.expiration_days == null || try(var.expiration_days >= 1 && floor(var.expiration_days) == var.expiration_days, false)
    error_message = "expiration_days must be a whole number of days >= 1, or null."
  }

  validation {
    condition     = var.expiration_days == null || var.cold_tier_transition_days == null || try(var.expiration_days > var.cold_tier_transition_days, false)
    error_message = "expiration_days must be greater than cold_tier_transition_days."
  }
}

variable "abort_incomplete_multipart_days" {
  description = "Days after which incomplete multipart uploads (a gateway that died mid-PUT) are aborted so their parts stop being billed."
  type        = number
  default     = 1

  validation {
    condition     = var.abort_incomplete_multipart_days >= 1 && floor(var.abort_incomplete_multipart_days) == var.abort_incomplete_multipart_days
    error_message = "abort_incomplete_multipart_days must be a whole number >= 1."
  }
}

################################################################################
# Lambda
################################################################################

variable "lambda_zip_path" {
  description = "Path of the gateway's Lambda zip built by `npm run build:lambda` (dist/lambda/kvgate-gateway.zip)."
  type        = string

  validation {
    condition     = endswith(var.lambda_zip_path, ".zip")
    error_message = "lambda_zip_path must point to a .zip file."
  }
}

variable "lambda_architecture" {
  description = "Instruction set of the function. arm64 (Graviton) is ~20% cheaper per GB-second."
  type        = string
  default     = "arm64"

  validation {
    condition     = contains(["arm64", "x86_64"], var.lambda_architecture)
    error_message = "lambda_architecture must be arm64 or x86_64."
  }
}

variable "lambda_memory_mb" {
  description = "Memory of the function in MB. CPU and network bandwidth scale with it; the gateway streams, so 1024 is plenty."
  type        = number
  default     = 1024

  validation {
    condition     = var.lambda_memory_mb >= 256 && var.lambda_memory_mb <= 10240
    error_message = "lambda_memory_mb must be between 256 and 10240."
  }
}

variable "lambda_timeout_seconds" {
  description = "Function timeout in seconds (bounds one PUT or streamed GET)."
  type        = number
  default     = 60

  validation {
    condition     = var.lambda_timeout_seconds >= 3 && var.lambda_timeout_seconds <= 900
    error_message = "lambda_timeout_seconds must be between 3 and 900."
  }
}

variable "reserved_concurrency" {
  description = "Reserved concurrent executions (caps the S3 request rate and the bill). Null leaves the function unreserved."
  type        = number
  default     = null

  validation {
    condition     = var.reserved_concurrency == null || try(var.reserved_concurrency >= 1, false)
    error_message = "reserved_concurrency must be >= 1 or null."
  }
}

variable "create_invoke_function_permission" {
  description = "Grant the public lambda:InvokeFunction that function URLs created since October 2025 also need. Set false when the account still has AWS's exception or you add a URL-scoped grant (`aws lambda add-permission --invoked-via-function-url`) yourself."
  type        = bool
  default     = true
}

variable "log_retention_days" {
  description = "Retention of the function's CloudWatch log group, in days."
  type        = number
  default     = 14

  validation {
    condition     = contains([1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653], var.log_retention_days)
    error_message = "log_retention_days must be a value CloudWatch Logs accepts (1, 3, 5, 7, 14, 30, 60, 90, ... 3653)."
  }
}

################################################################################
# Gateway configuration
################################################################################

variable "auth_tokens_json" {
  description = "Gateway token table as JSON (token SHA-256 hashes with their namespace scopes, as printed by `kvgate token`). Stored as an SSM SecureString read at cold start. Ignored when `auth_parameter_name` is set."
  type        = string
  default     = null
  sensitive   = true

  validation {
    condition     = var.auth_tokens_json == null || can(jsondecode(var.auth_tokens_json))
    error_message = "auth_tokens_json must be valid JSON."
  }
}

variable "auth_parameter_name" {
  description = "Name of an existing SSM SecureString parameter holding the token table (managed outside Terraform, e.g. rotated by another pipeline). Null makes the module create one from `auth_tokens_json`."
  type        = string
  default     = null

  validation {
    condition     = var.auth_parameter_name == null || can(regex("^/[a-zA-Z0-9_.\\-/]+$", var.auth_parameter_name))
    error_message = "auth_parameter_name must be a fully qualified SSM parameter name starting with '/'."
  }

  validation {
    condition     = var.auth_parameter_name != null || var.auth_tokens_json != null
    error_message = "Set auth_tokens_json or auth_parameter_name: the function URL is public, the gateway's bearer tokens are its only lock."
  }
}

variable "presign_threshold_bytes" {
  description = "GETs of objects larger than this answer 307 to a presigned S3 URL, so chunk bytes go straight from S3 to the client instead of through (and billed as) Lambda duration."
  type        = number
  default     = 1048576

  validation {
    condition     = var.presign_threshold_bytes >= 0
    error_message = "presign_threshold_bytes must be >= 0 (0 redirects every GET)."
  }
}

variable "presign_ttl_seconds" {
  description = "Lifetime of presigned GET URLs in seconds (also capped by the role session's lifetime)."
  type        = number
  default     = 300

  validation {
    condition     = var.presign_ttl_seconds >= 10 && var.presign_ttl_seconds <= 3600
    error_message = "presign_ttl_seconds must be between 10 and 3600."
  }
}

variable "max_chunk_bytes" {
  description = "Largest chunk body the function accepts on a direct PUT (413 above). A function URL request is capped at 6 MB of base64-encoded event, i.e. ~4.5 MiB of body; larger chunks take presigned uploads (upload_threshold_bytes, upload_max_bytes)."
  type        = number
  default     = 4194304

  validation {
    condition     = var.max_chunk_bytes >= 1024 && var.max_chunk_bytes <= 4718592
    error_message = "max_chunk_bytes must be between 1024 and 4718592 (4.5 MiB, what fits in a 6 MB Lambda request once base64-encoded)."
  }
}

################################################################################
# Scheduled gc (docs/cold-tier.md)
################################################################################

variable "gc_schedule_expression" {
  description = "EventBridge schedule on which the function runs `kvgate gc` (retention by last use, quotas, accounting). Null turns scheduled gc off; the lifecycle rules remain the backstop."
  type        = string
  default     = "rate(1 hour)"

  validation {
    condition     = var.gc_schedule_expression == null || can(regex("^(rate|cron)\\(.+\\)$", var.gc_schedule_expression))
    error_message = "gc_schedule_expression must be an EventBridge rate(...) or cron(...) expression, or null."
  }
}

variable "gc_grace" {
  description = "gc never deletes a chunk read or written within this long (e.g. 10m); longer than the gateways' use-record maxDelay (5m by default)."
  type        = string
  default     = "10m"

  validation {
    condition     = can(regex("^[0-9]+(ms|s|m|h|d)$", var.gc_grace))
    error_message = "gc_grace must be a duration like 10m or 1h."
  }
}

variable "namespace_policies" {
  description = "Per-namespace cold-tier policy: retention by last use (e.g. 30d) and a byte quota (e.g. 500GiB), evicting least-recently-used chains from their tails. Key \"*\" applies to unlisted namespaces; a namespace without a policy is only accounted."
  type = map(object({
    retention = optional(string)
    quota     = optional(string)
  }))
  default = {}

  validation {
    condition = alltrue([for ns, p in var.namespace_policies :
      (ns == "*" || can(regex("^[a-z0-9][a-z0-9._-]{0,62}$", ns))) &&
      (p.retention == null || can(regex("^[0-9]+(s|m|h|d)$", p.retention))) &&
      (p.quota == null || can(regex("^[0-9]+(\\.[0-9]+)?\\s*([KMGT]i?B|B)$", p.quota)))
    ])
    error_message = "namespace_policies: keys are namespaces (or \"*\"); retention like 30d, quota like 500GiB or 2TB."
  }
}

variable "upload_threshold_bytes" {
  description = "Chunk writes of at least this many bytes are answered with presigned S3 upload targets in the staging prefix (then verified and published by a commit call) instead of travelling through the function."
  type        = number
  default     = 1048576

  validation {
    condition     = var.upload_threshold_bytes >= 0
    error_message = "upload_threshold_bytes must be >= 0 (0 sends every write through presigned uploads)."
  }
}

variable "upload_max_bytes" {
  description = "Largest chunk object accepted through a presigned upload (a Llama-3.1-70B 256-token bf16 chunk is 80 MiB)."
  type        = number
  default     = 536870912

  validation {
    condition     = var.upload_max_bytes >= 1048576 && var.upload_max_bytes <= 5368709120
    error_message = "upload_max_bytes must be between 1 MiB and 5 GiB."
  }
}

variable "upload_ttl_seconds" {
  description = "Lifetime of presigned upload targets in seconds; a commit after it is refused (410) and the staged object removed."
  type        = number
  default     = 900

  validation {
    condition     = var.upload_ttl_seconds >= 60 && var.upload_ttl_seconds <= 3600
    error_message = "upload_ttl_seconds must be between 60 and 3600."
  }
}

variable "staging_expiration_days" {
  description = "Staged uploads that were never committed are deleted by a lifecycle rule after this many days (S3's smallest unit)."
  type        = number
  default     = 1

  validation {
    condition     = var.staging_expiration_days >= 1
    error_message = "staging_expiration_days must be >= 1."
  }
}
